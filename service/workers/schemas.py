"""What GET /v1/workers returns: a page of workers (service/workers/listing.py reads it as columns)."""

from datetime import datetime

from pydantic import BaseModel
from sqlalchemy import Row

from service.workers.models import Worker
from service.workers.service import shown_state

GiB = 2**30


class DevicePublic(BaseModel):
    """One device of a worker (a GPU, or a slot of CPU cores) and who holds it."""

    index: int
    uuid: str
    state: str  # free | held | unhealthy
    job: str | None = None  # the job holding it (hidden when another owner's, shown to a user)
    node_rank: int | None = None
    memory_gb: float | None = None
    numa_node: int | None = None
    cores: list[int] = []
    reason: str | None = None  # why it is unhealthy


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
    current_job: str | None  # one job it runs (the first by id, on a worker that runs several: see `jobs`)
    max_jobs: int = 1  # jobs it runs at once, each on devices of its own
    jobs: list[str] = []  # the jobs it runs now (those shown to the caller)
    devices: list[DevicePublic] = []  # its devices, their state and holder
    last_seen: datetime

    @classmethod
    def of(cls, worker: Worker | Row, *, now: datetime, lost_after_s: float, show_job: bool = True,
           held: dict[int, tuple[str, int]] | None = None, shown: set[str] | None = None) -> "WorkerPublic":
        """show_job=False hides the job it runs (another owner's, shown to a user); `held`: its devices' holders
        (device -> (job, node)), of which only the jobs in `shown` are named (None: all)."""
        memory = round(worker.memory_bytes / GiB, 3) if worker.memory_bytes else None
        held = held or {}

        def visible(job: str) -> bool:
            return shown is None or job in shown

        devices = []
        for d in worker.devices or []:
            job, node = held.get(d["index"], (None, None))
            state = "held" if job else ("free" if d.get("healthy", True) else "unhealthy")
            devices.append(DevicePublic(index=d["index"], uuid=d["uuid"], state=state,
                                        job=job if job and visible(job) else None,
                                        node_rank=node if job and visible(job) else None,
                                        memory_gb=round(d["memory_bytes"] / GiB, 3) if d.get("memory_bytes") else None,
                                        numa_node=d.get("numa_node"), cores=d.get("cores") or [],
                                        reason=d.get("reason")))
        jobs = sorted({j for j, _ in held.values() if visible(j)})
        return cls(id=worker.id, host=worker.host, address=worker.address, device=worker.device,
                   slots=worker.slots, busy_slots=worker.busy_slots, memory_gb=memory, labels=worker.labels or {},
                   state=shown_state(worker, now=now, lost_after_s=lost_after_s), pressure=worker.pressure,
                   current_job=worker.current_job if show_job else None, max_jobs=worker.max_jobs or 1,
                   jobs=jobs, devices=devices, last_seen=worker.last_seen)


class WorkersPublic(BaseModel):
    items: list[WorkerPublic]
    next_cursor: str | None = None  # the next page's cursor (the last id of this one); None: the last page
