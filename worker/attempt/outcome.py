"""What an attempt's end means for its job: the outcome the worker records (worker/agent.py record)."""

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from service.settings import Settings
from trainjobs import paths
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType, JobStatus
from worker.root_cause import disk_full
from worker.watch import Watch

log = logging.getLogger(__name__)
DEVICE_UNHEALTHY = ErrorType.DEVICE_UNHEALTHY  # a device of the attempt's turned unhealthy (worker/devices.py)


@dataclass
class Outcome:
    status: JobStatus
    exit_code: int | None = None
    summary: dict | None = None
    error: dict | None = None
    killed_pids: list[int] = field(default_factory=list)
    detail: str | None = None  # for the job's event log (e.g. why it was handed back)


def stopped(stop_reason: str | None, exit_code: int | None, killed: list[int], *, spec: JobSpec,
            settings: Settings, watch: Watch, node_rank: int, device_problem: str | None = None,
            unsafe: str | None = None) -> Outcome | None:
    """The failure of an attempt the worker stopped for a reason of its own (its time, its watch, its lease, a
    device of its gone bad); None for any other end (a cancel, a preemption, the ranks' own exit)."""
    base = {"rank": None, "exit_code": exit_code}
    if unsafe is not None:  # whatever else ended it: the job planted a link or a FIFO where the worker reads
        error = {"type": ErrorType.UNSAFE_FILE, **base, "message": f"{unsafe}: the worker reads a job's files only "
                 "when they are regular files of its own, and stopped reading it"}
    elif stop_reason == "timeout":
        error = {"type": ErrorType.TIMEOUT, "message": f"job ran past timeout_s={spec.timeout_s:g}", **base}
    elif stop_reason == "hung":
        error = {"type": ErrorType.HANG, "message": watch.hang_message, **base, "final": watch.hang_action == "fail"}
    elif stop_reason == "idle":  # idle.action fail: retrying would idle again
        error = {"type": ErrorType.IDLE, "message": watch.idle_message, **base, "final": True}
    elif stop_reason == "lost":
        error = {"type": ErrorType.ATTEMPT_LOST, "message": "another attempt or a cancel took the job", **base}
    elif stop_reason == "lease_expired":  # as the sweeper would say it: a lost worker, retried at once
        error = {"type": ErrorType.WORKER_LOST, **base, "node_rank": node_rank,
                 "message": f"the worker could not renew its lease for over lease_s={settings.lease_s:g}s "
                            "(the database was out of reach); its ranks were stopped"}
    elif stop_reason == "device_unhealthy":  # retried elsewhere: the device is out of placement now
        error = {"type": DEVICE_UNHEALTHY, "message": device_problem, **base, "node_rank": node_rank}
    else:
        return None
    return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)


def remove_partial_checkpoints(job_dir: Path, *, spec: JobSpec, gang: bool) -> list[str]:
    """The built-in runtime's checkpoints this attempt left half-written (no COMPLETE: never loaded), removed
    once its ranks are gone, so that a disk they filled has its space back before the outcome is written (on
    `trainjobs up` the database shares that disk). Not a gang's (another node may still be writing the same
    folder), nor a user's own script's: its folders are its own."""
    if gang or spec.entrypoint is not None:
        return []
    removed = []
    for folder in paths.partial_checkpoints(job_dir):
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return removed


def out_of_space(error: dict, *, job_id: str, dirs: list[Path], settings: Settings, was_short: bool,
                 removed: list[str]) -> dict | None:
    """A failure that was a write out of space: disk_full, naming the disk (and the checkpoint it left
    half-written, removed). Retried, on a worker with space: this one takes no job while under pressure
    (worker/inventory.py DiskWatch)."""
    full = disk_full(error, dirs=dirs, min_free=settings.worker_min_free_bytes, was_short=was_short)
    if full is None:
        return None
    if removed:
        full["message"] += f"; its partial checkpoint {', '.join(removed)} was removed"
    log.error("job %s: %s", job_id, full["message"])
    return full
