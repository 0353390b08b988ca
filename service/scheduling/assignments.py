"""The `assignments` table: the one scheduler's placements of queued jobs on workers (issue 42, step 5).

A row says: this job's node goes to this worker, on these devices, decided by this pass. The pass writes it with a
compare-and-set (the job still queued at the attempt it planned, and no row for it yet: the primary key), takes
the devices' holds in the same transaction, then moves the job's queue entry onto the worker's own queue. The row
lives until the job leaves `queued` (claimed, cancelled) or the assignment is undone (unclaimed, its worker lost,
given back); the next pass deletes it then (service/jobs/assigner.py).
"""

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Index, Integer, PrimaryKeyConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Assignment(Base):
    __tablename__ = "assignments"

    job_id: Mapped[str] = mapped_column(String(32))
    node_rank: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str] = mapped_column(String(256))
    devices: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))  # None: the whole worker
    attempt: Mapped[int] = mapped_column(Integer)  # the job's attempt count when assigned: a claim moves it on
    pass_no: Mapped[int] = mapped_column(BigInteger)  # the pass that assigned it
    assigned_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When its worker took the entry off its queue and found it still fits (the `assignment` call): claiming it.
    taken_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (PrimaryKeyConstraint("job_id", "node_rank", name="pk_assignments"),
                      Index("ix_assignments_worker", "worker_id"))
