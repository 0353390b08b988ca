"""A sweep's row: what was asked (the SweepSpec, seed filled in), whose it is and where it stands. Its trials are
jobs (jobs.sweep_id, jobs.sweep_trial)."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # as a job's: time-ordered
    owner: Mapped[str] = mapped_column(String(128))
    # The submitter's rights when it was submitted: the controller makes each trial as that principal would.
    role: Mapped[str] = mapped_column(String(16))
    can_run_entrypoints: Mapped[bool] = mapped_column(Boolean)
    name: Mapped[str] = mapped_column(String(128))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)  # trainjobs.sweep.SweepSpec, as JSON
    status: Mapped[str] = mapped_column(String(16))  # trainjobs.states.SweepStatus
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)  # failed: why a trial could not be made

    __table_args__ = (
        Index("ix_sweeps_owner_id", "owner", "id"),  # a user's list, newest first
        Index("ix_sweeps_status", "status"),  # the controller's running sweeps
    )
