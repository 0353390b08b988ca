"""The workers table: what each worker offers and when it was last heard from."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, PrimaryKeyConstraint, String, text
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)  # the worker's name (host-pid by default)
    host: Mapped[str] = mapped_column(String(256))
    address: Mapped[str] = mapped_column(String(256))  # where other nodes reach it (a gang's rendezvous)
    device: Mapped[str] = mapped_column(String(8))  # cpu | cuda
    slots: Mapped[int] = mapped_column(Integer)  # processes (CPU) or GPUs (CUDA) one job may use
    busy_slots: Mapped[int] = mapped_column(Integer, default=0)
    # Per device: one GPU's memory (the smallest), or on CPU the host's, which the ranks share.
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    host_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # How many jobs it runs at once (lanes, worker/main.py): each on its own devices (holds).
    max_jobs: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    # Its devices as placement sees them: [{index, uuid, memory_bytes, healthy, numa_node, cores, reason}].
    devices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    # The container images it has unpacked (references and sha256 digests, worker/images.py `cached`): the pass
    # prefers it for a job naming one (issue 44).
    images: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    # idle | busy | draining; "lost" is never stored: it is a last_seen older than the lease.
    state: Mapped[str] = mapped_column(String(16), default="idle")
    current_job: Mapped[str | None] = mapped_column(String(32))
    # Why the worker takes no job now, though it runs (a disk below its free space: worker/inventory.py DiskWatch).
    pressure: Mapped[str | None] = mapped_column(String(512))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The joined machine it runs on (worker_credentials.runner); None for a worker that writes the database itself.
    runner: Mapped[str | None] = mapped_column(String(128))

    __table_args__ = (Index("ix_workers_last_seen", "last_seen"),)


class Hold(Base):
    """A device of a worker held by one node of a job: the primary key is what keeps two jobs off one device.

    The worker's dispatcher inserts a job's holds when it takes the queue entry (attempt unset: pending), the
    claim binds them to the attempt, and the end of the attempt deletes them. A hold whose attempt is no longer
    active, or a pending one older than a claim takes, is stale: the worker's next take sweeps it
    (service/workers/holds.py).
    """

    __tablename__ = "holds"

    worker_id: Mapped[str] = mapped_column(String(256))
    device: Mapped[int] = mapped_column(Integer)  # the device's index on that worker (a GPU, or a CPU slot)
    job_id: Mapped[str] = mapped_column(String(32))
    node_rank: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int | None] = mapped_column(Integer)  # None: taken, not yet claimed
    since: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (PrimaryKeyConstraint("worker_id", "device", name="pk_holds"),
                      Index("ix_holds_job", "job_id"))

