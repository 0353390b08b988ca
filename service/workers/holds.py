"""Which job holds which device of a worker (issue 30): the rows that keep two jobs off one device.

A worker that runs several jobs at once gives each node of a job its own devices (GPUs, or on a CPU machine
slots of cores). The scheduler's pass takes them when it assigns a job to the worker (`take_many`: pending, no
attempt yet; a worker takes a gang's node task's itself, `take`), the claim binds them to the attempt and stores
where it runs (`bind`), and the end of the attempt gives them back (`release`); an assignment undone gives back
its pending ones (`release_pending`). The primary key (worker, device) is the guarantee: two takes of one device,
from two passes, two lanes of a worker or two processes that think they are it, cannot both commit, on either
database.

A hold outlives its use only when its worker died: its attempt is then no longer active (the sweeper marked
it lost), or a pending one was never claimed. Such holds are stale: they count for nothing and the worker's
heartbeat (or its restart under the same name) deletes them.
"""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, case, delete, func, or_, outerjoin, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Attempt, Job
from service.workers.models import Hold, Worker
from trainjobs.states import AttemptStatus

PENDING_S = 120.0  # a hold taken with its queue entry is claimed within seconds: unclaimed this long, it is stale


@dataclass(frozen=True)
class Load:
    """What a worker's live holds add up to: the slots held and the jobs (nodes of jobs) holding them."""

    slots: int = 0
    jobs: int = 0
    job_ids: frozenset[str] = frozenset()


def _rows(db: Session, worker_ids: list[str] | None):
    query = (select(Hold, Attempt.status)
             .outerjoin(Attempt, and_(Attempt.job_id == Hold.job_id, Attempt.number == Hold.attempt,
                                      Attempt.node_rank == Hold.node_rank)))
    if worker_ids is not None:
        query = query.where(Hold.worker_id.in_(worker_ids))
    return db.execute(query).all()


def live_clause(now: datetime) -> ColumnElement[bool]:
    """`_live` in SQL, on holds outer-joined to their attempts (`joined`)."""
    return or_(and_(Hold.attempt.is_(None), Hold.since > now - timedelta(seconds=PENDING_S)),
               Attempt.status == AttemptStatus.ACTIVE)


def joined():
    """Holds, each with its attempt (none for a pending hold)."""
    return outerjoin(Hold, Attempt, and_(Attempt.job_id == Hold.job_id, Attempt.number == Hold.attempt,
                                         Attempt.node_rank == Hold.node_rank))


def held_on(db: Session, *, worker_ids: list[str]) -> dict[str, dict[int, tuple[str, int]]]:
    """These workers' live holds, as all_held gives them, filtered in SQL and read as columns (a page of
    GET /v1/workers: no ORM object per hold)."""
    out: dict[str, dict[int, tuple[str, int]]] = defaultdict(dict)
    if not worker_ids:
        return out
    query = (select(Hold.worker_id, Hold.device, Hold.job_id, Hold.node_rank).select_from(joined())
             .where(Hold.worker_id.in_(worker_ids), live_clause(utcnow())))
    for worker, device, job, node in db.execute(query):
        out[worker][device] = (job, node)
    return out


def _live(hold: Hold, status: str | None, now: datetime) -> bool:
    if hold.attempt is None:
        return (now - hold.since).total_seconds() < PENDING_S
    return status == AttemptStatus.ACTIVE


def held(db: Session, *, worker_id: str) -> dict[int, tuple[str, int]]:
    """The worker's live holds: device -> (job id, node rank)."""
    now = utcnow()
    return {h.device: (h.job_id, h.node_rank) for h, status in _rows(db, [worker_id]) if _live(h, status, now)}


def all_held(db: Session) -> dict[str, dict[int, tuple[str, int]]]:
    """Every worker's live holds: worker -> device -> (job id, node rank). Filtered in SQL and read as columns:
    the scheduler's pass reads the pool's (8,000 holds at 1,000 workers: 0.5 s as ORM objects, bench/assign_pass.py)."""
    out: dict[str, dict[int, tuple[str, int]]] = defaultdict(dict)
    query = (select(Hold.worker_id, Hold.device, Hold.job_id, Hold.node_rank).select_from(joined())
             .where(live_clause(utcnow())))
    for worker, device, job, node in db.execute(query):
        out[worker][device] = (job, node)
    return out


def loads(db: Session) -> dict[str, Load]:
    """Every worker's live holds, summed (one query for the pool)."""
    return {w: load_of(devices) for w, devices in all_held(db).items()}


def load_of(devices: dict[int, tuple[str, int]]) -> Load:
    """One worker's live holds (device -> (job, node rank), as all_held gives them), summed."""
    return Load(len(devices), len(set(devices.values())), frozenset(j for j, _ in devices.values()))


def by_job(db: Session, job_ids: list[str]) -> dict[str, list[Hold]]:
    """The holds of these jobs (for /v1/workers: which job holds each device)."""
    out: dict[str, list[Hold]] = defaultdict(list)
    for i in range(0, len(job_ids), 500):
        for h in db.scalars(select(Hold).where(Hold.job_id.in_(job_ids[i:i + 500]))):
            out[h.job_id].append(h)
    return out


def sweep(db: Session, *, worker_id: str) -> int:
    """Delete the worker's stale holds (their attempt ended without giving them back). The caller commits."""
    now = utcnow()
    stale = [h for h, status in _rows(db, [worker_id]) if not _live(h, status, now)]
    for h in stale:
        db.execute(delete(Hold).where(Hold.worker_id == worker_id, Hold.device == h.device, Hold.job_id == h.job_id))
    if stale:
        sync_worker(db, worker_id=worker_id)
    return len(stale)


def take(db: Session, *, worker_id: str, job_id: str, node_rank: int, devices: list[int]) -> bool:
    """Hold `devices` for one node of a job (pending until its claim binds them); False when any is held already.

    Commits: the holds are what another lane of this worker reads next, before this one's job is claimed."""
    now = utcnow()
    db.add_all(Hold(worker_id=worker_id, device=d, job_id=job_id, node_rank=node_rank, since=now) for d in devices)
    try:
        db.flush()
    except IntegrityError:
        db.rollback()
        return False
    sync_worker(db, worker_id=worker_id)
    db.commit()
    return True


def take_many(db: Session, takes: list[tuple[str, str, int, list[int]]]) -> None:
    """Hold the devices of many nodes at once (worker, job, node rank, devices), pending until their claims bind them:
    the scheduler's pass, one flush for all it places (an IntegrityError when any device is held already). The
    caller commits, with the assignments it writes (service/scheduling/assign.py)."""
    now = utcnow()
    db.add_all(Hold(worker_id=w, device=d, job_id=j, node_rank=n, since=now) for w, j, n, ds in takes for d in ds)
    db.flush()
    sync_workers(db, worker_ids=sorted({w for w, _, _, ds in takes if ds}))


def release_pending(db: Session, *, worker_id: str, job_id: str, node_rank: int = 0) -> int:
    """Give back a node's holds that no claim bound (an assignment undone); bound ones stay with their attempt.
    The caller commits."""
    done = db.execute(delete(Hold).where(Hold.worker_id == worker_id, Hold.job_id == job_id,
                                         Hold.node_rank == node_rank, Hold.attempt.is_(None))).rowcount
    if done:
        sync_worker(db, worker_id=worker_id)
    return done


def bind(db: Session, *, worker_id: str, job_id: str, node_rank: int, attempt: int,
         placement: dict | None = None) -> list[int]:
    """Tie a node's pending holds to its attempt (in the claim's transaction) and store where it runs; returns the
    devices it holds, in order ([] when it holds none: taken by a worker of an earlier version)."""
    db.execute(update(Hold).where(Hold.worker_id == worker_id, Hold.job_id == job_id, Hold.node_rank == node_rank)
               .values(attempt=attempt))
    devices = sorted(db.scalars(select(Hold.device).where(Hold.worker_id == worker_id, Hold.job_id == job_id,
                                                          Hold.node_rank == node_rank)))
    if devices:
        sync_worker(db, worker_id=worker_id)  # the claim counted the job's slots again (workers.occupy)
    if placement is not None:
        placement = {"node_rank": node_rank, "attempt": attempt, **placement}
        db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                         Attempt.node_rank == node_rank).values(placement=placement))
        job = db.scalars(select(Job).where(Job.id == job_id).with_for_update()
                         .execution_options(populate_existing=True)).first()
        if job is not None and job.attempt == attempt:  # the job shows its current attempt's nodes
            nodes = [p for p in job.placement or [] if p.get("attempt") == attempt and p.get("node_rank") != node_rank]
            job.placement = sorted([*nodes, placement], key=lambda p: p["node_rank"])
    return devices


def release(db: Session, *, worker_id: str, job_id: str, node_rank: int | None = None) -> None:
    """Give a job's devices on this worker back (all its nodes here, or one). The caller commits."""
    query = delete(Hold).where(Hold.worker_id == worker_id, Hold.job_id == job_id)
    if node_rank is not None:
        query = query.where(Hold.node_rank == node_rank)
    db.execute(query)
    sync_worker(db, worker_id=worker_id)


def sync_workers(db: Session, *, worker_ids: list[str]) -> None:
    """sync_worker for many workers in one statement (a pass that placed jobs on hundreds of them)."""
    if not worker_ids:
        return
    mine = Hold.worker_id == Worker.id
    count = select(func.count()).where(mine).scalar_subquery()
    db.execute(update(Worker).where(Worker.id.in_(worker_ids)).values(
        busy_slots=count, current_job=select(func.min(Hold.job_id)).where(mine).scalar_subquery(),
        state=case((Worker.state == "draining", "draining"), (count > 0, "busy"), else_="idle")))


def sync_worker(db: Session, *, worker_id: str) -> None:
    """The worker's row follows its holds: busy_slots, state (busy while any is held) and a current job."""
    count, job = db.execute(select(func.count(), func.min(Hold.job_id)).where(Hold.worker_id == worker_id)).one()
    db.execute(update(Worker).where(Worker.id == worker_id).values(
        busy_slots=count, current_job=job,
        state=case((Worker.state == "draining", "draining"), else_="busy" if count else "idle")))
