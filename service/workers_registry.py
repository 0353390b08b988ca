"""The memory a job's ranks get: the spec's word, else live workers' (the workers table), else a default.

A worker that stops its heartbeat stops counting once the lease (TRAINJOBS_LEASE_S) has passed.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.jobs.spec import JobSpec
from service.workers import service as workers

log = logging.getLogger(__name__)

GiB = 2**30
DEFAULT_GPU_MEMORY = 80 * GiB  # an A100/H100 "80 GB" card, when neither the spec nor a live worker says
DEFAULT_HOST_MEMORY = 16 * GiB  # a CPU job's host, when no live worker says


class WorkerMemory(BaseModel):
    """What one worker offers a job: its GPUs (the smallest one's memory) and its host memory."""

    device: Literal["cuda", "cpu"]
    gpu_count: int = 0
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    source: Literal["spec", "workers", "default"]
    shared: bool = False  # the ranks of a CPU job share one host's memory

    def per_rank(self, nproc: int) -> int:
        return self.total // nproc if self.shared else self.total


def plan_device(spec: JobSpec, workers: Sequence[WorkerMemory]) -> str:
    """The device kind to plan for; 'auto' is CUDA when the spec gives GPU memory or a live worker has a GPU."""
    if spec.resources.device != "auto":
        return spec.resources.device
    return "cuda" if spec.resources.gpu_memory_gb or any(w.gpu_count for w in workers) else "cpu"


def device_memory(spec: JobSpec, device: str, workers: Sequence[WorkerMemory]) -> DeviceMemory:
    """The spec's gpu_memory_gb (GiB per rank), else the smallest live worker's, else a default."""
    if spec.resources.gpu_memory_gb:
        return DeviceMemory(int(spec.resources.gpu_memory_gb * GiB), "spec")
    if device == "cuda":
        sizes = [w.gpu_memory_bytes for w in workers if w.gpu_count and w.gpu_memory_bytes]
        return DeviceMemory(min(sizes), "workers") if sizes else DeviceMemory(DEFAULT_GPU_MEMORY, "default")
    # NOTE: any worker may take a CPU job, and its ranks share that host's memory.
    sizes = [w.host_memory_bytes for w in workers if w.host_memory_bytes]
    return DeviceMemory(min(sizes) if sizes else DEFAULT_HOST_MEMORY, "workers" if sizes else "default", True)


def live_workers(db: Session, *, lost_after_s: float) -> list[WorkerMemory]:
    """Every worker heard from within lost_after_s, as the planner sees it (from the workers table)."""
    return [WorkerMemory(device="cuda" if w.device == "cuda" else "cpu",
                         gpu_count=w.slots if w.device == "cuda" else 0,
                         gpu_memory_bytes=w.memory_bytes if w.device == "cuda" else None,
                         host_memory_bytes=w.host_memory_bytes)
            for w in workers.live(db, lost_after_s=lost_after_s)]


def workers_for(db: Session, *, spec: JobSpec, lost_after_s: float) -> list[WorkerMemory]:
    """The live workers, when the plan needs them: a model to plan and no gpu_memory_gb in the spec."""
    if spec.model is None or spec.resources.gpu_memory_gb:
        return []
    return live_workers(db, lost_after_s=lost_after_s)
