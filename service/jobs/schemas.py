"""What the API returns for jobs."""

import math
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from service.jobs.models import Job
from service.lists import Listing
from trainjobs.states import TERMINAL, AttemptStatus


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None  # an entrypoint job's: what its script reported, if anything
    eta_s: float | None = None


class MemoryCheck(BaseModel):
    """The plan's estimate beside what the run measured, so the plan can be checked against reality."""

    estimated_mb: float | None  # the plan's per-device estimate for the strategy the job runs
    # The worker's summary.peak_mem_mb: torch.cuda.max_memory_allocated of rank 0 on CUDA; on CPU rank 0's
    # peak RSS, which also counts Python and torch themselves.
    measured_peak_mb: float | None


class Performance(BaseModel):
    """How fast the job trains: while it runs, the newest values of its series (samples_per_s, mfu, ...); once it
    has ended, its summary's figures: the built-in runtime's, or a script's report(flops_per_step=...).

    mfu is the model's FLOP/s over the devices' peak (trainjobs/peaks.py) in `precision`; it is absent where the
    FLOPs or the device are unknown. gpu_util and gpu_mem_peak_mb are NVML's, read by rank 0 on its GPU (absent on
    CPU); peak_mem_mb is torch's allocator peak on CUDA, the peak RSS on CPU.
    """

    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    flops_per_step: float | None = None
    peak_flops: float | None = None  # of one device
    precision: str | None = None
    device_name: str | None = None
    compiled: bool | None = None
    gpu_util: float | None = None  # percent, the mean of the samples
    gpu_mem_peak_mb: float | None = None
    peak_mem_mb: float | None = None


class JobPublic(BaseModel):
    id: str
    name: str
    owner: str
    status: str
    priority: str
    spec: dict[str, Any]
    attempt: int
    max_retries: int
    progress: Progress
    summary: dict[str, Any] | None
    error: dict[str, Any] | None
    plan: dict[str, Any] | None  # the memory plan (trainjobs/plan.py); null for an entrypoint job
    memory: MemoryCheck | None
    performance: Performance | None = None  # throughput and MFU: live while it runs, then the summary's
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    # While queued: why no worker has taken it (no live worker fits, all busy); while starting: what its worker is
    # doing before the ranks run (installing requirements, launching torchrun).
    pending_reason: str | None = None
    cloned_from: str | None = None  # the job this one was cloned from (POST /v1/jobs/{id}/clone)
    warnings: list[dict[str, Any]] = []  # what a user should know while it runs: {kind, message, rank, attempt, time}
    # Why it ended where the status alone does not say: "stopped_early" (cancelled by its sweep's early stopping,
    # not a failure); null otherwise.
    reason: str | None = None
    sweep_id: str | None = None  # a sweep's trial: its sweep (POST /v1/sweeps), its number there, its parameters
    sweep_trial: int | None = None
    sweep_params: dict[str, Any] | None = None
    # Where its current attempt runs, per node: worker, devices (GPU or CPU slot indices), GPU UUIDs, cores.
    placement: list[dict[str, Any]] = []

    @classmethod
    def of(cls, job: Job) -> "JobPublic":
        total = None if job.spec.entrypoint else job.spec.train.max_steps
        progress = {"total_steps": total, **(job.progress or {})}
        if job.status in TERMINAL:  # nothing left to wait for
            progress["eta_s"] = None
        return cls(
            id=job.id, name=job.name, owner=job.owner, status=job.status, priority=job.priority,
            spec=job.spec.model_dump(mode="json"), attempt=job.attempt, max_retries=job.max_retries,
            progress=Progress(**progress), summary=job.summary, error=job.error,
            plan=job.plan, memory=memory_check(job), performance=performance_of(job.summary) or (
                performance_of((job.progress or {}).get("performance")) if job.status == "running" else None),
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            cancel_requested_at=job.cancel_requested_at,
            pending_reason=job.pending_reason if job.status in ("queued", "starting") else None,
            warnings=job.warnings or [], cloned_from=job.cloned_from,
            reason=job.reason if job.status == "cancelled" else None,
            sweep_id=job.sweep_id, sweep_trial=job.sweep_trial, sweep_params=job.sweep_params,
            placement=[p for p in job.placement or [] if p.get("attempt") == job.attempt],
        )


class JobsPublic(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None


def memory_check(job: Job) -> MemoryCheck | None:
    estimate = (job.plan or {}).get(job.spec.strategy, {}).get("total_bytes")
    peak = (job.summary or {}).get("peak_mem_mb")
    if estimate is None and peak is None:
        return None
    return MemoryCheck(estimated_mb=round(estimate / 2**20, 3) if estimate is not None else None,
                       measured_peak_mb=peak)


def performance_of(summary: dict[str, Any] | None) -> Performance | None:
    """The summary's performance figures; a value of the wrong type (a script writes what it likes) is left out."""
    found = {}
    for name, info in Performance.model_fields.items():
        value = (summary or {}).get(name)
        if info.annotation == str | None:
            ok = isinstance(value, str) and len(value) <= 200
        elif info.annotation == bool | None:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            found[name] = value
    return Performance(**found) if found.keys() - {"peak_mem_mb", "compiled", "precision"} else None


class AttemptPublic(BaseModel):
    number: int
    worker: str
    node_rank: int
    status: AttemptStatus
    started_at: datetime
    finished_at: datetime | None
    lease_expires_at: datetime | None
    exit_code: int | None
    error: dict[str, Any] | None
    resumed_from_step: int | None  # None: it started from step 0
    stacks: dict[str, Any] | None = None  # every rank's stack: on a hang, or POST /v1/jobs/{id}/stacks

    model_config = {"from_attributes": True}


class AttemptsPublic(Listing):
    items: list[AttemptPublic]
    count: int
