"""The states of a job and of its attempts, the moves allowed between them, and the error types trainjobs names."""

from enum import StrEnum


class JobStatus(StrEnum):
    """The status of a job within its lifecycle at any given time."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset(JobStatus) - TERMINAL  # what counts against an owner's quota
LIVE = frozenset({JobStatus.STARTING, JobStatus.RUNNING})  # held by a worker, under a lease

# to-state -> the states it may be reached from (the WHERE of every compare-and-set).
ALLOWED_FROM: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.STARTING, JobStatus.RUNNING}),  # a retry
    JobStatus.STARTING: frozenset({JobStatus.QUEUED}),
    JobStatus.RUNNING: frozenset({JobStatus.STARTING}),
    JobStatus.SUCCEEDED: frozenset({JobStatus.RUNNING}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.STARTING, JobStatus.RUNNING}),
    JobStatus.CANCELLED: frozenset({JobStatus.QUEUED, JobStatus.STARTING, JobStatus.RUNNING}),
}


class SweepStatus(StrEnum):
    """A sweep: running until every trial is made and ended (succeeded), or cancelled; failed when a trial
    could not be made at all (its spec refused: the sweep's error says why)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    FAILED = "failed"


STOPPED_EARLY = "stopped_early"  # a job's reason: a sweep's early-stopping rule cancelled it (not a failure)


class AttemptStatus(StrEnum):
    """One node of one attempt: active while its worker holds the lease, then closed once, for good."""

    ACTIVE = "active"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"  # its lease expired: the worker died, hung or was cut off
    PREEMPTED = "preempted"  # handed back (its worker shut down) or its gang did not form: no retry spent
    STOPPED = "stopped"  # another node of its gang failed: no retry spent


class ErrorType(StrEnum):
    """The error types trainjobs itself names in a job's `error.type`.

    A rank's own exception keeps its class name there instead (ValueError, torch.OutOfMemoryError, ...).
    """

    WORKER_LOST = "worker_lost"  # the attempt's lease expired
    ATTEMPT_LOST = "attempt_lost"  # another attempt or a cancel took the job from under a running one
    TIMEOUT = "timeout"  # ran past timeout_s
    GANG_STOPPED = "gang_stopped"  # stopped because another node of the gang failed
    PROCESS_EXIT = "process_exit"  # a rank exited non-zero without a Python traceback to name
    ENTRYPOINT_DISABLED = "entrypoint_disabled"  # the worker does not run users' own code
    INVALID_ENTRYPOINT = "invalid_entrypoint"  # the script path leaves the scripts directory
    ENTRYPOINT_NOT_FOUND = "entrypoint_not_found"
    PACKAGE_UNAVAILABLE = "package_unavailable"  # the worker cannot read the job's package (deleted, not shared)
    UNSAFE_PACKAGE = "unsafe_package"  # the worker's own check of the package before unpacking refused it
    # A file the job left for the worker to read (its metrics, its ranks' error files) is a link, a FIFO, a device
    # or a hard link: the worker does not follow it (service/jobfiles.py), and the job fails naming the file.
    UNSAFE_FILE = "unsafe_file"
    INIT_FROM_UNAVAILABLE = "init_from_unavailable"  # spec.init_from's weights are gone (deleted, collected)
    HANG = "hang"  # no progress past the hang bound (spec.hang): the ranks' stacks are on the attempt
    IDLE = "idle"  # its devices (on CPU: every rank's CPU) below idle.min_util for idle.window_s, action fail
    REQUIREMENTS_FAILED = "requirements_failed"  # pip could not install entrypoint.requirements (pip's words)
    DISK_FULL = "disk_full"  # a write of the job's failed for want of space: the error names the disk and the path
    # The object store (TRAINJOBS_STORAGE_URL) kept its artifacts out past TRAINJOBS_STORE_WAIT_S.
    STORE_UNAVAILABLE = "store_unavailable"
    # A GPU the attempt held turned unhealthy (an NVML error, fallen off the bus): the error names it; retried on
    # devices that are not.
    DEVICE_UNHEALTHY = "device_unhealthy"
    # spec.image (worker/images.py): the worker could not pull or unpack it (its words: no such image, no access,
    # no skopeo here), or the image lacks what a rank needs ("image has no python3", "torch missing in the image").
    IMAGE_UNAVAILABLE = "image_unavailable"
    IMAGE_UNUSABLE = "image_unusable"
