"""Every change of a job's status and of its attempts, once: each a compare-and-set (DESIGN.md, rule 3).

The API (cancel), the sweeper (expired leases) and the worker (claim, join, form a gang, hold the lease
while shipping, finish, fail, hand back) change state only through these functions, so the rules below
live here and nowhere else:

- Lock order: a transaction that changes a job and its attempts locks the job's row first (lock_job), so
  the nodes of a gang, the sweeper and the API never deadlock on each other's attempt rows.
- Fencing: a move names the attempt it belongs to (`Job.attempt == attempt`); a stale worker whose job was
  given to a newer attempt changes nothing.
- Leases: an attempt's node holds the job while its lease (the database's clock, `lease_s` ahead) is fresh;
  closing one as lost needs it still expired in the UPDATE itself, so a renewal that raced the sweeper wins.
- An attempt is settled once: close_attempt moves only an `active` row.

The caller commits (except where a docstring says otherwise); zero rows moved means someone else won.
"""

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, case, func, or_, select, type_coerce, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import UTCDateTime, end_sessions, lock_within, utcnow
from service.errors import InvalidTransition
from service.jobs import retries
from service.jobs.models import Attempt, Job
from service.jobs.service import get, record_event
from service.sweeps.models import Sweep
from service.workers import fit
from service.workers import service as workers
from service.workers.models import Hold
from trainjobs.spec import JobSpec
from trainjobs.states import ALLOWED_FROM, LIVE, STOPPED_EARLY, AttemptStatus, ErrorType, JobStatus, SweepStatus

log = logging.getLogger(__name__)
SWEEP_LOCK_WAIT_S = 1.0  # how long the sweeper waits for a job's row (the worker's transactions take ms)
END_SESSIONS_WAIT_S = 5.0  # how long it waits for a lost worker's sessions that hold it to end


def lock_job(db: Session, job_id: str) -> Job | None:
    """The job's row, locked for this transaction (SQLite locks the whole file on the first write instead)."""
    return db.scalars(select(Job).where(Job.id == job_id).with_for_update()
                      .execution_options(populate_existing=True)).first()


def db_now(db: Session) -> ColumnElement:
    """The database's clock, in SQL: leases are set and judged by it alone, so a worker's clock may drift."""
    return _sqlite_time(db, "now") if db.get_bind().dialect.name == "sqlite" else func.now()


def read_db_now(db: Session) -> datetime:
    """The database's clock, read (once per transaction, where a time is also reported)."""
    return db.scalar(select(type_coerce(db_now(db), UTCDateTime())))


def lease_until(db: Session, lease_s: float) -> ColumnElement:
    """lease_s ahead of the database's clock, in SQL."""
    if db.get_bind().dialect.name == "sqlite":
        return _sqlite_time(db, "now", f"{lease_s:+.6f} seconds")
    return func.now() + timedelta(seconds=lease_s)  # NOTE: now() is the transaction's start: never later


def _sqlite_time(db: Session, *modifiers: str) -> ColumnElement:
    # SQLite has no time type: SQLAlchemy stores "YYYY-MM-DD HH:MM:SS.ffffff" and compares the text. This is
    # the same text (strftime gives milliseconds), so it compares and reads back as the values Python wrote.
    return func.strftime("%Y-%m-%d %H:%M:%f", *modifiers).concat("000")


def active_nodes(db: Session, *, job_id: str, attempt: int) -> int:
    """How many nodes of the attempt are still active (1 for a running single-node job)."""
    return db.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.status == AttemptStatus.ACTIVE))


def transition(db: Session, *, job_id: str, to: JobStatus, values: dict[str, Any] | None = None,
               attempt: int | None = None, where: list | None = None, detail: str | None = None,
               notify: str | None = None) -> bool:
    """Compare-and-set the job's status from the states ALLOWED_FROM `to`; False means someone else moved it.

    The event is recorded in the same transaction, and with it the webhooks' outbox rows (service/jobs/notify.py:
    the event the new status is, or `notify`'s where the status alone does not say, as for a hand-back).
    """
    query = update(Job).where(Job.id == job_id, Job.status.in_(ALLOWED_FROM[to]), *(where or []))
    if attempt is not None:  # fencing: only the attempt that holds the job may move it
        query = query.where(Job.attempt == attempt)
    changes = dict(values or {})
    if to == JobStatus.QUEUED:  # why it waited before, or what its attempt was doing: the sweeper says anew
        changes.setdefault("pending_reason", None)
    if to.is_terminal():
        changes.setdefault("finished_at", utcnow())
    result = db.execute(query.values(status=to, **changes).execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return False
    record_event(db, job_id=job_id, kind=to, detail=detail, notify=notify)
    return True


# --- the API -------------------------------------------------------------------------------------------------

def request_cancel(db: Session, *, job_id: str) -> tuple[Job, bool]:
    """Cancel a queued job at once, or ask the supervisors of a started one to stop it. Commits.

    Returns the job and whether it was queued (so the caller drops it from the queue).
    """
    job = get(db, job_id=job_id)
    # NOTE: the WHERE names queued again: a claim may have committed since the read above.
    if job.status == JobStatus.QUEUED and transition(db, job_id=job_id, to=JobStatus.CANCELLED,
                                                     where=[Job.status == JobStatus.QUEUED],
                                                     detail="cancelled while queued"):
        db.commit()
        db.refresh(job)
        return job, True
    asked = db.execute(update(Job).where(Job.id == job_id, Job.status.in_([*LIVE, JobStatus.QUEUED]),
                                         Job.cancel_requested_at.is_(None))
                       .values(cancel_requested_at=utcnow()).execution_options(synchronize_session=False))
    if asked.rowcount == 1:
        record_event(db, job_id=job_id, kind="cancel_requested")
    db.commit()
    db.refresh(job)
    if job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        raise InvalidTransition(f"job {job_id} already {job.status}; it cannot be cancelled", field="status")
    return job, False


def stop_early(db: Session, *, job_id: str, detail: str) -> bool:
    """A sweep's early stopping ends a trial: marked `stopped_early`, then cancelled by the normal path (queued:
    at once; started: its supervisor stops every process). Commits. False if it had ended or a cancel was asked."""
    marked = db.execute(update(Job).where(Job.id == job_id, Job.status.in_([*LIVE, JobStatus.QUEUED]),
                                          Job.cancel_requested_at.is_(None), Job.reason.is_(None))
                        .values(reason=STOPPED_EARLY).execution_options(synchronize_session=False))
    if marked.rowcount != 1:
        db.rollback()
        return False
    record_event(db, job_id=job_id, kind=STOPPED_EARLY, detail=detail)
    request_cancel(db, job_id=job_id)  # commits both: the row is ours (locked) since the UPDATE
    return True


def move_sweep(db: Session, *, sweep_id: str, to: SweepStatus, error: str | None = None) -> bool:
    """Compare-and-set a sweep out of running (every end is final); False means someone else ended it."""
    result = db.execute(update(Sweep).where(Sweep.id == sweep_id, Sweep.status == SweepStatus.RUNNING)
                        .values(status=to, finished_at=utcnow(), error=error)
                        .execution_options(synchronize_session=False))
    return result.rowcount == 1


# --- a worker takes a job ------------------------------------------------------------------------------------

def claim(db: Session, *, job_id: str, worker: str, lease_s: float) -> tuple[int, JobSpec] | None:
    """queued → starting, and open attempt N+1 (node 0) with its lease; None if the job is not there to take.

    A queued job whose cancel was asked is cancelled here instead.
    """
    moved = transition(
        db, job_id=job_id, to=JobStatus.STARTING, detail=f"claimed by {worker}",
        values={"attempt": Job.attempt + 1, "started_at": utcnow(), "pending_reason": None,
                "preempt_requested_at": None, "preempt_detail": None},
        # NOTE: a retry dequeued before its backoff ended is left for the sweeper to enqueue again.
        where=[Job.cancel_requested_at.is_(None), or_(Job.not_before.is_(None), Job.not_before <= utcnow())],
    )
    job = db.get(Job, job_id, populate_existing=True)
    if not moved:
        if job is not None and job.status == JobStatus.QUEUED and job.cancel_requested_at is not None:
            transition(db, job_id=job_id, to=JobStatus.CANCELLED, detail="cancelled before start")
        log.info("job %s not claimed (status %s)", job_id, job.status if job else "unknown")
        return None
    db.add(Attempt(job_id=job_id, number=job.attempt, worker=worker, node_rank=0, started_at=utcnow(),
                   status=AttemptStatus.ACTIVE, lease_expires_at=lease_until(db, lease_s)))
    spec = job.spec
    workers.occupy(db, worker_id=worker, job_id=job_id, slots=spec.resources.nproc_per_node)
    return job.attempt, spec


def join(db: Session, *, job_id: str, attempt: int, node_rank: int, worker: str, lease_s: float) -> JobSpec | None:
    """Take node `node_rank` of the gang forming for `attempt`; None when it formed, moved on or is taken.

    The unique (job, attempt, node) makes a second join of the same node fail; that rolls the transaction back.
    """
    job = lock_job(db, job_id)
    if (job is None or job.status != JobStatus.STARTING or job.attempt != attempt
            or job.cancel_requested_at is not None):
        log.info("node task %s/%s/%s skipped (the job moved on)", job_id, attempt, node_rank)
        return None
    spec = job.spec
    db.add(Attempt(job_id=job_id, number=attempt, worker=worker, node_rank=node_rank, started_at=utcnow(),
                   status=AttemptStatus.ACTIVE, lease_expires_at=lease_until(db, lease_s)))
    try:
        db.flush()
    except IntegrityError:  # that node is taken already
        db.rollback()
        return None
    workers.occupy(db, worker_id=worker, job_id=job_id, slots=spec.resources.nproc_per_node)
    record_event(db, job_id=job_id, kind="node_joined", detail=f"node {node_rank} on {worker}")
    return spec


def check_gang(db: Session, *, job_id: str, attempt: int, node_rank: int, lease_s: float, gang_timeout_s: float,
               offer: fit.Offer, address: str, endpoint: str | None = None) -> tuple[str | None, str]:
    """One look at a forming gang, renewing this node's lease: (endpoint, "formed"), (None, "waiting"), or
    (None, why) for lost | cancelled | timeout | yielded.

    Node 0 forms it once every node is in: it picks a free port on its address (or takes `endpoint`, the one its
    worker found free, where this runs in the API, not on node 0's machine), records the endpoint and
    moves the job to running. A gang not formed in gang_timeout_s, or younger than another forming gang
    that could use this worker, lets every node go (so two half-formed gangs never deadlock).
    """
    job = lock_job(db, job_id)
    if job is None or job.attempt != attempt or job.status not in LIVE:
        return None, "lost"
    if not renew_lease(db, job_id=job_id, attempt=attempt, node_rank=node_rank, lease_s=lease_s):
        return None, "lost"
    if job.cancel_requested_at is not None:
        if transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                      detail="cancelled while its gang was forming"):
            close_gang(db, job_id=job_id, attempt=attempt, why="cancelled", status=AttemptStatus.CANCELLED)
        return None, "cancelled"
    if job.status == JobStatus.RUNNING:
        return db.scalar(select(Attempt.endpoint).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                                         Attempt.node_rank == 0)), "formed"
    nnodes = job.spec.resources.nnodes
    members = active_nodes(db, job_id=job_id, attempt=attempt)
    waited = (utcnow() - job.started_at).total_seconds()
    if node_rank == 0 and members == nnodes:
        endpoint = endpoint or f"{address}:{free_port(address)}"
        db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt, Attempt.node_rank == 0)
                   .values(endpoint=endpoint))
        transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=attempt,
                   detail=f"gang of {nnodes} formed in {waited:.1f}s; rendezvous at {endpoint}")
        return endpoint, "formed"
    if waited > gang_timeout_s:
        release_gang(db, job_id=job_id, attempt=attempt,
                     why=f"gang not formed in {gang_timeout_s:g}s ({members} of {nnodes} nodes)")
        return None, "timeout"
    older = older_forming_gang(db, job=job, offer=offer)
    if older is not None:
        release_gang(db, job_id=job_id, attempt=attempt, why=f"yielded its workers to the older forming gang {older}")
        return None, "yielded"
    return None, "waiting"


def free_port(address: str) -> int:
    """A port free on `address` now (torchrun on node 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def older_forming_gang(db: Session, *, job: Job, offer: fit.Offer) -> str | None:
    """A gang that began forming before this one, still lacks nodes, and could use this worker."""
    for other in db.scalars(select(Job).where(Job.status == JobStatus.STARTING, Job.id != job.id,
                                              Job.started_at <= job.started_at)):
        if (other.started_at, other.id) >= (job.started_at, job.id):
            continue
        need = fit.need_of(other.spec, other.plan)
        if need.nodes < 2 or fit.misfit(need, offer) is not None:
            continue
        if active_nodes(db, job_id=other.id, attempt=other.attempt) < need.nodes:
            return other.id
    return None


def release_gang(db: Session, *, job_id: str, attempt: int, why: str) -> bool:
    """A gang that did not form lets every node go; the job goes back to the queue at once, no retry spent."""
    if not transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt, detail=why,
                      where=[Job.status == JobStatus.STARTING],
                      values={"not_before": utcnow(), "pending_reason": why}):
        return False
    close_gang(db, job_id=job_id, attempt=attempt, why=why, status=AttemptStatus.PREEMPTED)
    log.info("job %s attempt %s: %s", job_id, attempt, why)
    return True


# --- while it runs -------------------------------------------------------------------------------------------

def start_running(db: Session, *, job_id: str, attempt: int, detail: str) -> bool:
    """starting → running, once the ranks are launched (a gang moved when it formed)."""
    return transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=attempt, detail=detail)


def renew_lease(db: Session, *, job_id: str, attempt: int, node_rank: int, lease_s: float | None) -> bool:
    """Push this node's lease lease_s ahead (None: leave it, only check); False once the node is closed."""
    expires = lease_until(db, lease_s) if lease_s is not None else Attempt.lease_expires_at
    return db.execute(update(Attempt).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.node_rank == node_rank,
        Attempt.status == AttemptStatus.ACTIVE).values(lease_expires_at=expires)).rowcount == 1


@dataclass(frozen=True)
class Held:
    """What a node that still holds its job learns on each renewal."""

    cancel_requested: bool
    progress_step: int  # the job's progress as stored (a gang's nodes move it in turn)
    stacks_requested_at: datetime | None = None  # POST /v1/jobs/{id}/stacks: the latest request
    preempt_detail: str | None = None  # the scheduler asks it to hand its workers back (to whom, and why)
    stopped_early: bool = False  # the cancel is a sweep's early stopping: work already done is kept


def hold(db: Session, *, job_id: str, attempt: int, node_rank: int, lease_s: float | None) -> Held | None:
    """Lock the job, confirm this node of `attempt` still holds it and renew its lease; None once it is lost.

    The worker's lease thread (worker/lease.py) calls it in a short transaction of its own. On None the caller
    rolls back.
    """
    job = db.execute(select(Job.attempt, Job.status, Job.cancel_requested_at, Job.progress, Job.stacks_requested_at,
                            Job.preempt_requested_at, Job.preempt_detail, Job.reason)
                     .where(Job.id == job_id).with_for_update()).one_or_none()
    renewed = renew_lease(db, job_id=job_id, attempt=attempt, node_rank=node_rank, lease_s=lease_s)
    if job is None or job.attempt != attempt or job.status not in LIVE or not renewed:
        return None
    return Held(cancel_requested=job.cancel_requested_at is not None,
                progress_step=(job.progress or {}).get("step") or 0, stacks_requested_at=job.stacks_requested_at,
                preempt_detail=(job.preempt_detail or "preempted") if job.preempt_requested_at is not None else None,
                stopped_early=job.reason == STOPPED_EARLY)


def attempt_workers(db: Session, *, refs: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], str]:
    """Which worker runs each (job, attempt, node) of `refs` that exists: the API checks that a worker acts only on
    its own attempts (service/runners/router.py)."""
    if not refs:
        return {}
    rows = db.execute(select(Attempt.job_id, Attempt.number, Attempt.node_rank, Attempt.worker)
                      .where(Attempt.job_id.in_({job for job, _, _ in refs}))).all()
    wanted = set(refs)
    return {(r.job_id, r.number, r.node_rank): r.worker for r in rows if (r.job_id, r.number, r.node_rank) in wanted}


def still_held(db: Session, *, job_id: str, attempt: int, node_rank: int) -> Held | None:
    """Whether this node of `attempt` still holds the job, read without a lock and without renewing: the fence of a
    shipping transaction (the attempt's logs and metrics are written after it). Once the sweeper has given the job
    to a newer attempt (this worker was paused or cut off past its lease), nothing more is written for this one.
    """
    job = db.execute(select(Job.attempt, Job.status, Job.cancel_requested_at, Job.progress)
                     .where(Job.id == job_id)).one_or_none()
    if job is None or job.attempt != attempt or job.status not in LIVE:
        return None
    active = db.scalar(select(Attempt.number).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                                    Attempt.node_rank == node_rank,
                                                    Attempt.status == AttemptStatus.ACTIVE))
    if active is None:
        return None
    return Held(cancel_requested=job.cancel_requested_at is not None,
                progress_step=(job.progress or {}).get("step") or 0)


# --- an attempt ends -----------------------------------------------------------------------------------------

def close_attempt(db: Session, *, job_id: str, attempt: int, status: AttemptStatus, error: dict | None = None,
                  exit_code: int | None = None, node_rank: int = 0, only_if_expired: bool = False) -> bool:
    """Close the attempt (on one node) if it is still active; False if someone else closed it first.

    only_if_expired (the sweeper's): its lease must still be expired, so a renewal that raced the sweeper's read
    wins. A worker that stopped its own ranks past its lease closes it as lost without it (its drain renewed it).
    """
    expired = [Attempt.lease_expires_at < db_now(db)] if only_if_expired else []
    return db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                            Attempt.node_rank == node_rank, Attempt.status == AttemptStatus.ACTIVE,
                                            *expired)
                      .values(status=status, finished_at=utcnow(), lease_expires_at=None, error=error,
                              exit_code=exit_code)).rowcount == 1


def close_gang(db: Session, *, job_id: str, attempt: int, why: str,
               status: AttemptStatus = AttemptStatus.STOPPED) -> int:
    """Close every node of the attempt still active ("stopped": not counted against max_retries)."""
    return db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                            Attempt.status == AttemptStatus.ACTIVE)
                      .values(status=status, finished_at=utcnow(), lease_expires_at=None,
                              error={"type": ErrorType.GANG_STOPPED,
                                     "message": f"stopped with its gang ({why})"})).rowcount


def finish_node(db: Session, *, job_id: str, attempt: int, node_rank: int, status: JobStatus,
                summary: dict | None, error: dict | None, exit_code: int | None) -> bool:
    """A node ended well (or was cancelled): close it; the last node of the gang moves the job.

    The job row is locked first, so of two nodes finishing at once exactly one sees the other closed.
    A single-node job is a gang of one. Returns whether the job moved (or this node's end was recorded).
    """
    job = lock_job(db, job_id)
    if job is None or job.attempt != attempt:
        return False
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=AttemptStatus(status.value), error=error,
                         exit_code=exit_code, node_rank=node_rank):
        return False
    if summary is not None:  # the node whose rank 0 reported it
        db.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt).values(summary=summary))
    if active_nodes(db, job_id=job_id, attempt=attempt):
        return True
    values = {"error": error} if error else {}
    if status == JobStatus.SUCCEEDED:  # a sweep's stop that came once the work was done stopped nothing
        values["reason"] = case((Job.reason == STOPPED_EARLY, None), else_=Job.reason)
    return transition(db, job_id=job_id, to=status, attempt=attempt, values=values,
                      detail=(error or {}).get("message"))


def settle_failure(db: Session, *, job_id: str, attempt: int, error: dict,
                   attempt_status: AttemptStatus = AttemptStatus.FAILED, exit_code: int | None = None,
                   node_rank: int = 0, only_if_expired: bool = False) -> JobStatus | None:
    """Close the attempt (this node of it) as failed or lost, then requeue the job or fail it (the retry rule,
    service/jobs/retries.py); None if the job moved on. The other nodes of a gang are closed as stopped: their
    supervisors see it and stop their ranks.
    """
    job = lock_job(db, job_id)
    if job is None:
        return None
    earlier = history(db, job_id)
    # NOTE: once a cancel is asked, a node that dies (a gang's node whose ranks a peer's SIGTERM killed before
    # its supervisor read the flag) ends the job cancelled, as the user asked, not failed.
    cancelled = job.cancel_requested_at is not None
    if cancelled and attempt_status == AttemptStatus.FAILED:
        attempt_status = AttemptStatus.CANCELLED
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=attempt_status, error=error,
                         exit_code=exit_code, node_rank=node_rank, only_if_expired=only_if_expired):
        return None  # already settled (the sweeper found it lost, or the worker recorded it): never twice
    close_gang(db, job_id=job_id, attempt=attempt, why=f"node {node_rank}: {error.get('message')}",
               status=AttemptStatus.CANCELLED if cancelled else AttemptStatus.STOPPED)
    if cancelled:
        moved = transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                           detail=f"cancelled; node {node_rank} ended with: {error.get('message')}")
        return JobStatus.CANCELLED if moved else None
    failures = db.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job_id, Attempt.status.in_(retries.COUNTED)))
    causes = [*({"attempt": e["attempt"], "type": e.get("type"), "message": e.get("message")} for e in earlier),
              {"attempt": attempt, "type": error.get("type"), "message": error.get("message")}]
    recorded = {**error, "attempts": causes}
    if failures <= job.max_retries and retries.is_retryable(error, earlier):
        wait = retries.wait_s(error, failures)
        if transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt,
                      detail=f"retry {failures}/{job.max_retries} in {wait:.0f}s: {error.get('message')}",
                      values={"error": recorded, "not_before": utcnow() + timedelta(seconds=wait),
                              "queued_at": utcnow()}):
            return JobStatus.QUEUED
    moved = transition(db, job_id=job_id, to=JobStatus.FAILED, attempt=attempt, detail=error.get("message"),
                       values={"error": recorded})
    return JobStatus.FAILED if moved else None


def history(db: Session, job_id: str) -> list[dict]:
    """Every earlier attempt's error, oldest first."""
    rows = db.execute(select(Attempt.number, Attempt.error).where(Attempt.job_id == job_id, Attempt.error.is_not(None))
                      .order_by(Attempt.number)).all()
    return [{"attempt": n, **e} for n, e in rows if e]


def hand_back(db: Session, *, job_id: str, attempt: int, detail: str, node_rank: int = 0) -> bool:
    """A worker shutting down, or a preemption the scheduler asked for, returns the job (its whole gang) to the
    queue: not a failure, no retry spent."""
    lock_job(db, job_id)
    if not close_attempt(db, job_id=job_id, attempt=attempt, status=AttemptStatus.PREEMPTED, node_rank=node_rank):
        return False
    close_gang(db, job_id=job_id, attempt=attempt, why=f"node {node_rank}: {detail}")
    if transition(db, job_id=job_id, to=JobStatus.QUEUED, attempt=attempt, detail=detail, notify="job.preempted",
                  values={"not_before": utcnow(), "queued_at": utcnow(), "preempt_requested_at": None,
                          "preempt_detail": None}, where=[Job.cancel_requested_at.is_(None)]):
        return True
    # A cancel came in while the ranks were stopping: it wins, and the job must not stay running.
    return transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                      detail="cancelled while its worker was shutting down",
                      where=[Job.cancel_requested_at.is_not(None)])


def take_back(db: Session, *, owned: Callable[[str], bool], detail: str) -> list[str]:
    """Every active attempt of the workers `owned` says are a revoked machine's, handed back (its jobs queued again,
    no retry spent), each in a transaction of its own. Its worker learns it at its next lease renewal (a 401): it
    stops the ranks and writes nothing more. The jobs handed back. Commits."""
    rows = db.execute(select(Attempt.job_id, Attempt.number, Attempt.node_rank, Attempt.worker)
                      .where(Attempt.status == AttemptStatus.ACTIVE)).all()
    db.rollback()
    taken = []
    for row in rows:
        if owned(row.worker) and hand_back(db, job_id=row.job_id, attempt=row.number, node_rank=row.node_rank,
                                           detail=detail):
            taken.append(row.job_id)
        db.commit()
    return taken


# --- replays: a worker's call sent again after its answer was lost (service/runners/attempt_calls.py) ----------
# They read only: the compare-and-sets above already refuse to move anything twice; these say whether what the
# first call did is what this one asks, so the replay answers as the first did.

def claimed_by(db: Session, *, job_id: str, worker: str) -> tuple[int, JobSpec] | None:
    """The attempt `worker` claimed of `job_id` that has not begun (its answer may have been lost): (number, spec);
    None for another worker's, once it moved on, or once its devices were bound to it (the answer did arrive:
    another lane of that worker, taking a second queue entry of the job, must not run it too)."""
    job = db.get(Job, job_id, populate_existing=True)
    if job is None or job.status != JobStatus.STARTING:
        return None
    node = db.scalar(select(Attempt.worker).where(Attempt.job_id == job_id, Attempt.number == job.attempt,
                                                  Attempt.node_rank == 0, Attempt.status == AttemptStatus.ACTIVE))
    bound = db.scalar(select(func.count()).select_from(Hold).where(
        Hold.worker_id == worker, Hold.job_id == job_id, Hold.node_rank == 0, Hold.attempt == job.attempt))
    return (job.attempt, job.spec) if node == worker and not bound else None


def joined_by(db: Session, *, job_id: str, attempt: int, node_rank: int, worker: str) -> JobSpec | None:
    """The spec of the gang's node that `worker` joined and that still waits for the gang to form (a join's
    replay); None otherwise."""
    job = db.get(Job, job_id, populate_existing=True)
    if job is None or job.status != JobStatus.STARTING or job.attempt != attempt or job.cancel_requested_at:
        return None
    node = db.scalar(select(Attempt.worker).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                                  Attempt.node_rank == node_rank,
                                                  Attempt.status == AttemptStatus.ACTIVE))
    return job.spec if node == worker else None


def runs(db: Session, *, job_id: str, attempt: int) -> bool:
    """Whether the job is running with `attempt` (start_running's replay, or a gang that formed)."""
    return db.scalar(select(func.count()).select_from(Job).where(
        Job.id == job_id, Job.attempt == attempt, Job.status == JobStatus.RUNNING)) == 1


def node_end(db: Session, *, job_id: str, attempt: int, node_rank: int) -> tuple[str, dict | None, int | None] | None:
    """How this node of the attempt was closed: (status, error, exit code); None while it is active, or without
    such a node."""
    row = db.execute(select(Attempt.status, Attempt.error, Attempt.exit_code).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.node_rank == node_rank)).one_or_none()
    return None if row is None or row.status == AttemptStatus.ACTIVE else (row.status, row.error, row.exit_code)


# --- the sweeper ---------------------------------------------------------------------------------------------

def expire_leases(db: Session) -> list[str]:
    """Attempts whose worker stopped renewing: the attempt is lost; the job is retried or failed. Commits.

    A gang still forming has run nothing: it lets its other nodes go, and no retry is spent.
    """
    now = read_db_now(db)
    rows = db.execute(
        select(Attempt.job_id, Attempt.number, Attempt.node_rank, Attempt.worker, Attempt.lease_expires_at,
               Job.status, Job.spec)
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.status == AttemptStatus.ACTIVE, Attempt.lease_expires_at < now, Job.attempt == Attempt.number,
               Job.status.in_(LIVE))
    ).all()
    settled = []
    for job_id, number, node_rank, worker, expired, job_status, spec in rows:
        if not take_from_lost(db, job_id=job_id, worker=worker, began_before=now):
            log.warning("job %s attempt %s: its row stays locked though worker %s lost its lease; the next pass "
                        "tries again", job_id, number, worker)
            continue
        message = f"worker {worker} stopped renewing its lease ({(now - expired).total_seconds():.1f}s past expiry)"
        if job_status == JobStatus.STARTING and spec.resources.nnodes > 1:
            if release_gang(db, job_id=job_id, attempt=number, why=f"node {node_rank}: {message}"):
                settled.append(job_id)
                log.warning("job %s attempt %s: worker %s lost while its gang formed; job queued", job_id, number,
                            worker)
            continue
        error = {"type": ErrorType.WORKER_LOST, "rank": None, "worker": worker, "node_rank": node_rank,
                 "message": message}
        status = settle_failure(db, job_id=job_id, attempt=number, error=error, attempt_status=AttemptStatus.LOST,
                                node_rank=node_rank, only_if_expired=True)
        if status is not None:
            settled.append(job_id)
            log.warning("job %s attempt %s: worker %s lost; job %s", job_id, number, worker, status)
    db.commit()
    return settled


def take_from_lost(db: Session, *, job_id: str, worker: str, began_before: datetime) -> bool:
    """Lock the job whose lease `worker` let run out, within a bounded wait; False if it stays locked.

    A holder that keeps the row past the wait is the lost worker frozen inside a transaction (paused, SIGSTOP),
    which the server's idle timeout does not always end (service/db.py, make_engine): its sessions whose
    transaction began before `began_before` (this pass's start) end here, and their transactions roll back, so
    it writes nothing more; should it wake, it finds its connection closed, and then its job gone.
    """
    if lock_within(db, SWEEP_LOCK_WAIT_S, lambda: lock_job(db, job_id)):
        return True
    ended = end_sessions(db, name=worker, began_before=began_before, wait_s=END_SESSIONS_WAIT_S)
    if ended:
        log.warning("job %s: ended the sessions %s of worker %s, whose lease ran out holding the job", job_id, ended,
                    worker)
    return bool(ended) and lock_within(db, SWEEP_LOCK_WAIT_S, lambda: lock_job(db, job_id))
