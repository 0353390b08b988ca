"""The retry rule: whether an attempt that ended badly is worth another, and how long the job waits first.

Pure: service/jobs/lifecycle.py applies it wherever an attempt can end (the worker recording its outcome,
the sweeper finding a lease that expired).
"""

from trainjobs.states import AttemptStatus, ErrorType

# The user's code is wrong, or the job is over: another attempt would end the same way.
FINAL_TYPES = frozenset({
    "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "NameError", "SyntaxError",
    "ImportError", "ModuleNotFoundError", "AssertionError", "NotImplementedError", "ZeroDivisionError",
    ErrorType.TIMEOUT, ErrorType.ENTRYPOINT_DISABLED, ErrorType.INVALID_ENTRYPOINT, ErrorType.ENTRYPOINT_NOT_FOUND,
    ErrorType.ATTEMPT_LOST, ErrorType.PACKAGE_UNAVAILABLE, ErrorType.UNSAFE_PACKAGE,
    ErrorType.UNSAFE_FILE,  # the job planted a link or a FIFO where the worker reads: it would again
    ErrorType.REQUIREMENTS_FAILED,  # pip's answer for the same list is the same: a typo, a missing release
    ErrorType.INIT_FROM_UNAVAILABLE,
    ErrorType.IMAGE_UNUSABLE,  # the image lacks python3 or torch: it will on every worker
    ErrorType.IDLE,  # idle.action fail: the user asked for no second try of a job that sat idle
    "NonFiniteLoss",  # a diverged run (worker/train/main.py, train.stop_on_nan) diverges again from its checkpoint
})
# The attempt statuses that spend max_retries; a hand-back (preempted) or a gang's other nodes (stopped) do not.
COUNTED = (AttemptStatus.FAILED, AttemptStatus.LOST)
BACKOFF_S, BACKOFF_MAX_S = 2.0, 60.0


def is_retryable(error: dict, previous: list[dict]) -> bool:
    """Lost workers, signals, OOM, collective timeouts, rendezvous errors: yes. A user error, or the same twice: no."""
    if error.get("type") in FINAL_TYPES:
        return False
    if error.get("type") == ErrorType.HANG:  # hang.action retry: once; a second hang fails the job
        return not error.get("final") and not any(e.get("type") == ErrorType.HANG for e in previous)
    same = [e for e in previous if e.get("type") == error.get("type") and e.get("message") == error.get("message")]
    return not same or error.get("type") == ErrorType.WORKER_LOST  # a machine can die twice; code fails the same way


def backoff_s(failures: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** max(0, failures - 1))


def wait_s(error: dict, failures: int) -> float:
    """How long a retry waits: a lost worker says nothing about the job, so none; else the backoff."""
    return 0.0 if error.get("type") == ErrorType.WORKER_LOST else backoff_s(failures)
