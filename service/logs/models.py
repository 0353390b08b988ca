"""The combined torchrun output of a job, stored as byte-addressed chunks."""

from sqlalchemy import ForeignKey, Index, Integer, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base


class LogChunk(Base):
    __tablename__ = "log_chunks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer, default=0)
    seq: Mapped[int] = mapped_column(Integer)
    # Byte offset of this chunk in the job's whole log (UTF-8), so readers can resume anywhere.
    start: Mapped[int] = mapped_column(Integer)
    length: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_log_chunks_job_start", "job_id", "start"),)
