"""What GET /v1/workers returns."""

from datetime import datetime

from pydantic import BaseModel

from service.workers.models import Worker
from service.workers.service import shown_state

GiB = 2**30


class WorkerPublic(BaseModel):
    id: str
    host: str
    address: str
    device: str
    slots: int
    busy_slots: int
    memory_gb: float | None  # per device: one GPU's, or on CPU the host's (shared by the ranks), in GiB
    labels: dict[str, str]
    state: str  # idle | busy | draining | lost
    pressure: str | None = None  # why it takes no jobs now though it runs (a disk below its free space)
    current_job: str | None
    last_seen: datetime

    @classmethod
    def of(cls, worker: Worker, *, now: datetime, lost_after_s: float, show_job: bool = True) -> "WorkerPublic":
        """show_job=False hides the job it runs (another owner's, shown to a user)."""
        memory = round(worker.memory_bytes / GiB, 3) if worker.memory_bytes else None
        return cls(id=worker.id, host=worker.host, address=worker.address, device=worker.device,
                   slots=worker.slots, busy_slots=worker.busy_slots, memory_gb=memory, labels=worker.labels or {},
                   state=shown_state(worker, now=now, lost_after_s=lost_after_s), pressure=worker.pressure,
                   current_job=worker.current_job if show_job else None,
                   last_seen=worker.last_seen)


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]
