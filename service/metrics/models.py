"""Per-step scalar metrics of a job."""

from datetime import datetime

from sqlalchemy import Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Metric(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index("ix_metrics_job_name_step", "job_id", "name", "step"),)


class MetricBlock(Base):
    """A summary of one series over BLOCK_STEPS consecutive steps (service/metrics/blocks.py), kept exact as
    points are written, so that a chart of a long series reads summaries rather than every point."""

    __tablename__ = "metric_blocks"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    block: Mapped[int] = mapped_column(Integer, primary_key=True)  # step // BLOCK_STEPS
    points: Mapped[int] = mapped_column(Integer)  # distinct steps in the block
    last_step: Mapped[int] = mapped_column(Integer)
    last_value: Mapped[float] = mapped_column(Float)
    min_step: Mapped[int] = mapped_column(Integer)  # the first step holding the block's minimum
    min_value: Mapped[float] = mapped_column(Float)
    max_step: Mapped[int] = mapped_column(Integer)
    max_value: Mapped[float] = mapped_column(Float)
