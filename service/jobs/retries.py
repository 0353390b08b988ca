"""What happens to a job when an attempt ends badly: back to the queue (with backoff), or failed.

One rule for every place an attempt can end: the worker recording its outcome, the sweeper finding a
lease that expired, a worker handing a job back on shutdown.
"""

from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.jobs.status import JobStatus

# The user's code is wrong, or the job is over: another attempt would end the same way.
FINAL_TYPES = frozenset({
    "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "NameError", "SyntaxError",
    "ImportError", "ModuleNotFoundError", "AssertionError", "NotImplementedError", "ZeroDivisionError",
    "timeout", "entrypoint_disabled", "invalid_entrypoint", "entrypoint_not_found", "attempt_lost",
})
COUNTED = ("failed", "lost")  # attempt statuses that spend max_retries; "preempted" does not
BACKOFF_S, BACKOFF_MAX_S = 2.0, 60.0


def is_retryable(error: dict, previous: list[dict]) -> bool:
    """Lost workers, signals, OOM, collective timeouts, rendezvous errors: yes. A user error, or the same twice: no."""
    if error.get("type") in FINAL_TYPES:
        return False
    same = [e for e in previous if e.get("type") == error.get("type") and e.get("message") == error.get("message")]
    return not same or error.get("type") == "worker_lost"  # a machine can die twice; code fails the same way


def backoff_s(failures: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** max(0, failures - 1))


def history(db: Session, job_id: str) -> list[dict]:
    """Every earlier attempt's error, oldest first."""
    rows = db.execute(select(Attempt.number, Attempt.error).where(Attempt.job_id == job_id, Attempt.error.is_not(None))
                      .order_by(Attempt.number)).all()
    return [{"attempt": n, **e} for n, e in rows if e]


def settle_failure(db: Session, *, job_id: str, attempt: int, error: dict, attempt_status: str = "failed",
                   exit_code: int | None = None) -> JobStatus | None:
    """Close the attempt as failed or lost, then requeue the job or fail it; None if the job moved on.

    The caller commits. Fenced by attempt: a stale worker cannot settle a newer attempt.
    """
    job = db.get(Job, job_id)
    if job is None:
        return None
    earlier = history(db, job_id)
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=attempt_status, error=error,
                         exit_code=exit_code):
        return None  # already settled (the sweeper found it lost, or the worker recorded it): never twice
    failures = db.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job_id, Attempt.status.in_(COUNTED)))
    causes = [*({"attempt": e["attempt"], "type": e.get("type"), "message": e.get("message")} for e in earlier),
              {"attempt": attempt, "type": error.get("type"), "message": error.get("message")}]
    recorded = {**error, "attempts": causes}
    retry = failures <= job.max_retries and is_retryable(error, earlier) and job.cancel_requested_at is None
    if retry:
        # A lost worker says nothing about the job: straight back to the queue for another worker.
        wait = 0.0 if error.get("type") == "worker_lost" else backoff_s(failures)
        moved = jobs.transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt,
                                detail=f"retry {failures}/{job.max_retries} in {wait:.0f}s: {error.get('message')}",
                                values={"error": recorded, "not_before": utcnow() + timedelta(seconds=wait),
                                        "queued_at": utcnow()})
        if moved:
            return JobStatus.QUEUED
    moved = jobs.transition(db, job_id=job_id, to=JobStatus.FAILED, attempt=attempt,
                            detail=error.get("message"), values={"error": recorded})
    return JobStatus.FAILED if moved else None


def hand_back(db: Session, *, job_id: str, attempt: int, detail: str) -> bool:
    """A worker shutting down returns the job to the queue: not a failure, no retry spent."""
    if not close_attempt(db, job_id=job_id, attempt=attempt, status="preempted"):
        return False
    if jobs.transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt, detail=detail,
                       values={"not_before": utcnow(), "queued_at": utcnow()},
                       where=[Job.cancel_requested_at.is_(None)]):
        return True
    # A cancel came in while the ranks were stopping: it wins, and the job must not stay running.
    return jobs.transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                           detail="cancelled while its worker was shutting down",
                           where=[Job.cancel_requested_at.is_not(None)])


def close_attempt(db: Session, *, job_id: str, attempt: int, status: str, error: dict | None = None,
                  exit_code: int | None = None) -> bool:
    """Close the attempt if it is still active; False if someone else closed it first."""
    return db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                     Attempt.status == "active")
               .values(status=status, finished_at=utcnow(), lease_expires_at=None, error=error,
                       exit_code=exit_code)).rowcount == 1
