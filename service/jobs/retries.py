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
COUNTED = ("failed", "lost")  # attempt statuses that spend max_retries; "preempted" and "stopped" do not
BACKOFF_S, BACKOFF_MAX_S = 2.0, 60.0


def lock_job(db: Session, job_id: str) -> Job | None:
    """The job's row, locked for this transaction.

    NOTE: every transaction that changes a job and its attempts locks the job row first (the supervisor's
    shipping, a gang's join and formation, these outcomes), so the nodes of a gang and the sweeper never
    deadlock on each other's attempt rows.
    """
    return db.scalars(select(Job).where(Job.id == job_id).with_for_update()
                      .execution_options(populate_existing=True)).first()


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
                   exit_code: int | None = None, node_rank: int = 0) -> JobStatus | None:
    """Close the attempt (this node of it) as failed or lost, then requeue the job or fail it; None if the job
    moved on. The other nodes of a gang are closed as stopped: their supervisors see it and stop their ranks.

    The caller commits. Fenced by attempt: a stale worker cannot settle a newer attempt.
    """
    job = lock_job(db, job_id)
    if job is None:
        return None
    earlier = history(db, job_id)
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=attempt_status, error=error,
                         exit_code=exit_code, node_rank=node_rank):
        return None  # already settled (the sweeper found it lost, or the worker recorded it): never twice
    close_gang(db, job_id=job_id, attempt=attempt, why=f"node {node_rank}: {error.get('message')}")
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


def hand_back(db: Session, *, job_id: str, attempt: int, detail: str, node_rank: int = 0) -> bool:
    """A worker shutting down returns the job (its whole gang) to the queue: not a failure, no retry spent."""
    lock_job(db, job_id)
    if not close_attempt(db, job_id=job_id, attempt=attempt, status="preempted", node_rank=node_rank):
        return False
    close_gang(db, job_id=job_id, attempt=attempt, why=f"node {node_rank}: {detail}")
    if jobs.transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt, detail=detail,
                       values={"not_before": utcnow(), "queued_at": utcnow()},
                       where=[Job.cancel_requested_at.is_(None)]):
        return True
    # A cancel came in while the ranks were stopping: it wins, and the job must not stay running.
    return jobs.transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                           detail="cancelled while its worker was shutting down",
                           where=[Job.cancel_requested_at.is_not(None)])


def close_attempt(db: Session, *, job_id: str, attempt: int, status: str, error: dict | None = None,
                  exit_code: int | None = None, node_rank: int = 0) -> bool:
    """Close the attempt (on one node) if it is still active; False if someone else closed it first.

    Closing it as lost also needs its lease still expired: a renewal that raced the sweeper's read wins.
    """
    expired = [Attempt.lease_expires_at < utcnow()] if status == "lost" else []
    return db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                            Attempt.node_rank == node_rank, Attempt.status == "active", *expired)
                      .values(status=status, finished_at=utcnow(), lease_expires_at=None, error=error,
                              exit_code=exit_code)).rowcount == 1


def release_gang(db: Session, *, job_id: str, attempt: int, why: str) -> bool:
    """A gang that did not form lets every node go; the job goes back to the queue at once, no retry spent."""
    if not jobs.transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt, detail=why,
                           where=[Job.status == JobStatus.STARTING],
                           values={"not_before": utcnow(), "pending_reason": why}):
        return False
    close_gang(db, job_id=job_id, attempt=attempt, why=why, status="preempted")
    return True


def close_gang(db: Session, *, job_id: str, attempt: int, why: str, status: str = "stopped") -> int:
    """Close every node of the attempt still active ("stopped": not counted against max_retries)."""
    return db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                            Attempt.status == "active")
                      .values(status=status, finished_at=utcnow(), lease_expires_at=None,
                              error={"type": "gang_stopped", "message": f"stopped with its gang ({why})"})).rowcount


def finish_node(db: Session, *, job_id: str, attempt: int, node_rank: int, status: JobStatus,
                summary: dict | None, error: dict | None, exit_code: int | None) -> bool:
    """A node ended well (or was cancelled): close it; the last node of the gang moves the job.

    The job row is locked first, so of two nodes finishing at once exactly one sees the other closed.
    A single-node job is a gang of one. Returns whether the job moved (or this node's end was recorded).
    """
    job = lock_job(db, job_id)
    if job is None or job.attempt != attempt:
        return False
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=status.value, error=error,
                         exit_code=exit_code, node_rank=node_rank):
        return False
    if summary is not None:  # the node whose rank 0 reported it
        db.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt).values(summary=summary))
    left = db.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.status == "active"))
    if left:
        return True
    values = {"error": error} if error else {}
    return jobs.transition(db, job_id=job_id, to=status, attempt=attempt, values=values,
                           detail=(error or {}).get("message"))
