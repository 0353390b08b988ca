"""Job states and the transitions allowed between them."""

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

# to-state -> the states it may be reached from (the WHERE of every compare-and-set).
ALLOWED_FROM: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.STARTING, JobStatus.RUNNING}),  # a retry
    JobStatus.STARTING: frozenset({JobStatus.QUEUED}),
    JobStatus.RUNNING: frozenset({JobStatus.STARTING}),
    JobStatus.SUCCEEDED: frozenset({JobStatus.RUNNING}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.STARTING, JobStatus.RUNNING}),
    JobStatus.CANCELLED: frozenset({JobStatus.QUEUED, JobStatus.STARTING, JobStatus.RUNNING}),
}
