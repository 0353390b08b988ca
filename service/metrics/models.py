"""Per-step scalar metrics of a job."""

from datetime import datetime

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Metric(Base):
    __tablename__ = "metrics"

    # 64-bit: a deployment stores more than 2^31 points in its life. SQLite's INTEGER PRIMARY KEY is the 64-bit rowid
    # already (and only that exact type autoincrements there), so it keeps it.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    # NOTE: no foreign key to jobs (migration 0027): its per-row check was ~40% of PostgreSQL's CPU a point. A
    # point is written only by a ship fenced on its attempt holding the job, and the service deletes no job; code
    # that ever does must delete its points too (retention deletes points and keeps the job).
    job_id: Mapped[str] = mapped_column(String(32))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    # The node of a gang whose local rank 0 reported it (0 for a one-node job). Node 0's points are the job's
    # series; each other node's are its own (its step time, its memory).
    node_rank: Mapped[int] = mapped_column(Integer, server_default="0")
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (
        Index("ix_metrics_job_node_name_step", "job_id", "node_rank", "name", "step"),  # a series, in step order
        Index("ix_metrics_job_node_id", "job_id", "node_rank", "id"),  # the event stream's cursor, and its end
    )


class MetricBlock(Base):
    """A summary of one series over BLOCK_STEPS consecutive steps (service/metrics/blocks.py), kept exact as
    points are written, so that a chart of a long series reads summaries rather than every point."""

    __tablename__ = "metric_blocks"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True, server_default="0")
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    block: Mapped[int] = mapped_column(Integer, primary_key=True)  # step // BLOCK_STEPS
    points: Mapped[int] = mapped_column(Integer)  # distinct steps in the block
    last_step: Mapped[int] = mapped_column(Integer)
    last_value: Mapped[float] = mapped_column(Float)
    min_step: Mapped[int] = mapped_column(Integer)  # the first step holding the block's minimum
    min_value: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(Integer)
    max_value: Mapped[float] = mapped_column(Float)
