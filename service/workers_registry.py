"""The memory a job's ranks get: the spec's word, else live workers' reports (in Redis, with a TTL), else a default.

A worker that stops refreshing its key simply disappears after TTL_S: no cleanup pass needed.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ValidationError
from redis import Redis
from redis.exceptions import RedisError

from service.jobs.spec import JobSpec

log = logging.getLogger(__name__)

GiB = 2**30
DEFAULT_GPU_MEMORY = 80 * GiB  # an A100/H100 "80 GB" card, when neither the spec nor a live worker says
DEFAULT_HOST_MEMORY = 16 * GiB  # a CPU job's host, when no live worker says
REFRESH_S = 15.0
TTL_S = 45  # three missed refreshes and the worker no longer counts


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


def worker_key(prefix: str, name: str) -> str:
    return f"{prefix}:workers:{name}"


def publish(redis: Redis, *, prefix: str, name: str, memory: WorkerMemory, ttl_s: int = TTL_S) -> None:
    redis.set(worker_key(prefix, name), memory.model_dump_json(), ex=ttl_s)


def live_workers(redis: Redis, *, prefix: str) -> list[WorkerMemory]:
    """Every worker whose report has not expired; none when Redis cannot be read (the plan then uses defaults)."""
    try:
        keys = list(redis.scan_iter(match=worker_key(prefix, "*"), count=500))
        values = redis.mget(keys) if keys else []
    except RedisError:
        log.warning("cannot read the workers' memory from Redis; planning with defaults")
        return []
    workers = []
    for value in values:
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            workers.append(WorkerMemory.model_validate_json(value))
        except ValidationError:
            log.warning("skipping an unreadable worker report: %r", value[:200])
    return workers


def workers_for(redis: Redis, *, prefix: str, spec: JobSpec) -> list[WorkerMemory]:
    """The live workers, when the plan needs them: a model to plan and no gpu_memory_gb in the spec."""
    if spec.model is None or spec.resources.gpu_memory_gb:
        return []
    return live_workers(redis, prefix=prefix)
