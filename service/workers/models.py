"""The workers table: what each worker offers and when it was last heard from."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, String
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
    # idle | busy | draining; "lost" is never stored: it is a last_seen older than the lease.
    state: Mapped[str] = mapped_column(String(16), default="idle")
    current_job: Mapped[str | None] = mapped_column(String(32))
    # Why the worker takes no job now, though it runs (a disk below its free space: worker/inventory.py DiskWatch).
    pressure: Mapped[str | None] = mapped_column(String(512))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    __table_args__ = (Index("ix_workers_last_seen", "last_seen"),)
