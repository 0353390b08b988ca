"""The scheduler's pass, its database side (issue 42, step 5): one plan places queued jobs on workers and devices.

The control plane plans the pool once per pass (policy.plan, on the snapshot service.py reads); for each job the
plan starts now, this module picks its devices on the worker the plan gives it (placement.choose, keeping off the
devices the plan keeps for other jobs: a reservation's, a forming gang's), records the assignment (a
compare-and-set on the job still queued and unassigned: assignments.py) and takes the devices' holds in the same
transaction, so the next pass sees them used. The queue side (the entry moved onto the worker's own queue) and
the loop are service/jobs/assigner.py's; the worker only checks that what it is given still fits.

It also says what becomes of the assignments of earlier passes (`verdict`): a claimed job's is done, one unclaimed
after two passes or whose worker is lost is undone and planned again.
"""

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import JSON, Integer, bindparam, delete, insert, literal, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Job
from service.scheduling import placement, policy
from service.scheduling import service as scheduling
from service.scheduling.assignments import Assignment
from service.workers import holds
from service.workers.models import Worker
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
UNCLAIMED_PASSES = 2  # passes an assignment may wait on its worker's queue before it is planned again


@dataclass(frozen=True)
class Placed:
    """A job this pass assigned: node 0 on `worker_id`, on `devices` (None: the whole worker, devices unknown)."""

    job_id: str
    priority: str
    worker_id: str
    devices: tuple[int, ...] | None


@dataclass(frozen=True)
class Open:
    """An assignment of an earlier pass, with its job as it is now (status None: the job is gone)."""

    job_id: str
    node_rank: int
    worker_id: str
    devices: tuple[int, ...] | None
    attempt: int
    pass_no: int
    assigned_at: datetime
    taken_at: datetime | None
    status: str | None
    job_attempt: int | None
    priority: str | None


def open_assignments(db: Session) -> list[Open]:
    a = Assignment
    rows = db.execute(select(a.job_id, a.node_rank, a.worker_id, a.devices, a.attempt, a.pass_no, a.assigned_at,
                             a.taken_at, Job.status, Job.attempt, Job.priority)
                      .outerjoin(Job, Job.id == a.job_id)).all()
    return [Open(job, node, worker, tuple(devices) if devices is not None else None, attempt, number, at, taken,
                 status, job_attempt, priority)
            for job, node, worker, devices, attempt, number, at, taken, status, job_attempt, priority in rows]


def verdict(row: Open, *, number: int, live: Collection[str], on_priority_queue: Collection[str], now: datetime,
            unclaimed_s: float) -> str | None:
    """What becomes of an earlier assignment (None: it stands):

    - "claimed": its job left `queued` through a claim (its attempt moved on): the row is done;
    - "ended": its job left `queued` unclaimed (cancelled, gone): its holds and its entry go;
    - "given back": its entry is on a priority queue again (the worker gave it back, or its claim put it back);
    - "lost": its worker is no longer live;
    - "unclaimed": UNCLAIMED_PASSES passes (and `unclaimed_s`) went by and no claim came: planned again, unless its
      worker took it (`taken_at`) and is claiming it (the caller's: it stands holds.PENDING_S at most).
    """
    if row.status is None or row.status != JobStatus.QUEUED:
        return "claimed" if row.job_attempt is not None and row.job_attempt != row.attempt else "ended"
    if row.job_attempt != row.attempt:
        return "claimed"  # claimed, then back to queued (a retry): this assignment was spent
    if row.job_id in on_priority_queue:
        return "given back"
    if row.worker_id not in live:
        return "lost"
    if (number - row.pass_no >= UNCLAIMED_PASSES or number < row.pass_no) and \
            (now - row.assigned_at).total_seconds() >= unclaimed_s:
        return "unclaimed"
    return None


def forget(db: Session, row: Open, *, release: bool) -> None:
    """Delete an assignment (the caller commits); `release`: its devices' unclaimed holds go back too."""
    db.execute(delete(Assignment).where(Assignment.job_id == row.job_id, Assignment.node_rank == row.node_rank))
    if release:
        holds.release_pending(db, worker_id=row.worker_id, job_id=row.job_id, node_rank=row.node_rank)


def for_pass(snap: policy.Snapshot, *, standing: Sequence[Open]) -> policy.Snapshot:
    """The snapshot this pass plans: the queued jobs none assigned already (one being claimed is); and an
    assignment that holds no devices (its worker's devices unknown) still fills its worker. A job with no entry on
    a priority queue (lost with Redis until the reconciler enqueues it again, or before its submission's enqueue)
    is planned, so its reason, its place and its reservation show, but not assigned (`placements`)."""
    assigned = {o.job_id for o in standing}
    needs = {w.id: w.need.slots for w in snap.waiting}
    bare: dict[str, tuple[str, int]] = {}
    for o in standing:
        if o.devices is None:
            job, slots = bare.get(o.worker_id, (o.job_id, 0))
            bare[o.worker_id] = (job, slots + needs.get(o.job_id, 1))
    nodes = []
    for node in snap.nodes:
        if node.id in bare:
            job, slots = bare[node.id]
            node = dataclasses.replace(node, running=node.running or job) if node.room is None else \
                dataclasses.replace(node, room=max(0, node.room - slots))
        nodes.append(node)
    return dataclasses.replace(snap, nodes=nodes,
                               waiting=[w for w in snap.waiting if w.id not in assigned])


def pick(machine: placement.Machine, free: set[int], need: int, job_id: str, kept: Mapping[str, tuple[int, ...]],
         let: Mapping[str, set[int]]) -> tuple[int, ...] | None:
    """The devices a job's node gets of those free: a job the plan holds devices for gets exactly them; any other
    job the best linked set of the rest, else (as the plan places it: open slots first) of those too that a
    reservation lets it take."""
    own = kept.get(job_id)
    if own is not None and len(own) == need and {d.index for d in machine.devices if d.healthy
                                                 and d.index in free}.issuperset(own):
        return own
    others = set().union(*(d for j, d in kept.items() if j != job_id))
    chosen = placement.choose(machine, free - others, need)
    if chosen is None and let.get(job_id):
        chosen = placement.choose(machine, free - (others - let[job_id]), need)
    return chosen


class _Devices:
    """Each worker's machine (devices, links, health) and its devices free as this pass hands them out: a shared
    worker's from the snapshot (Node.machine, free_devices), any other's read from its row and its holds."""

    def __init__(self, db: Session, plan: policy.Plan, snap: policy.Snapshot, worker_ids: Collection[str]):
        self.plan, self.snap = plan, snap
        self.waiting = {w.id: w for w in snap.waiting}
        self.machines: dict[str, placement.Machine | None] = {}
        self.free: dict[str, set[int]] = {}
        nodes = {n.id: n for n in snap.nodes}
        rest = []
        for w in worker_ids:
            node = nodes.get(w)
            if node is not None and node.machine is not None and node.free_devices is not None:
                self.machines[w], self.free[w] = node.machine, set(node.free_devices)
            else:
                rest.append(w)
        if rest:
            held = holds.held_on(db, worker_ids=rest)
            for w, kind, rows in db.execute(select(Worker.id, Worker.device, Worker.devices)
                                            .where(Worker.id.in_(rest))):
                machine = self.machines[w] = scheduling.machine_of(w, kind, rows)
                if machine is not None:
                    self.free[w] = {d.index for d in machine.devices if d.healthy} - set(held.get(w, {}))

    def let(self, worker_id: str, job: policy.Waiting) -> dict[str, set[int]]:
        here = [r for r in self.plan.reservations if worker_id in r.devices and r.job_id != job.id
                and r.lets(job, self.snap.now)]
        return {job.id: set().union(*(r.devices[worker_id] for r in here))} if here else {}

    def take(self, worker_id: str, job: policy.Waiting) -> tuple[int, ...] | None | bool:
        """Its devices on this worker, marked used for the rest of the pass; None: the whole worker (its devices
        unknown); False: too few free now (it waits for a later pass)."""
        machine = self.machines.get(worker_id)
        if machine is None:
            return None
        free = self.free[worker_id]
        chosen = pick(machine, free, job.need.slots, job.id, self.plan.kept.get(worker_id, {}),
                      self.let(worker_id, job))
        if chosen is None:
            return False
        free.difference_update(chosen)
        return tuple(chosen)


def placements(db: Session, snap: policy.Snapshot, plan: policy.Plan, *, entries: Collection[str]) -> list[Placed]:
    """The jobs the plan starts now that wait on a priority queue (`entries`: the pass moves their entry), each on
    its first worker (node 0; a gang's other nodes join through the gang queue's node tasks, as before) with the
    devices placement picks there."""
    starting = [p for p in plan.order if p.workers and p.reason is None and p.job_id in entries]
    devices = _Devices(db, plan, snap, {p.workers[0] for p in starting})
    out = []
    for p in starting:
        job = devices.waiting.get(p.job_id)
        if job is None:
            continue
        chosen = devices.take(p.workers[0], job)
        if chosen is False:
            log.info("job %s: too few devices free on %s now; it waits for the next pass", job.id, p.workers[0])
            continue
        out.append(Placed(job.id, job.priority, p.workers[0], chosen))
    return out


_RECORD = insert(Assignment.__table__).from_select(
    ["job_id", "node_rank", "worker_id", "devices", "attempt", "pass_no", "assigned_at"],
    select(Job.id, literal(0, Integer), bindparam("b_worker"), bindparam("b_devices", type_=JSON(none_as_null=True)),
           Job.attempt, bindparam("b_pass"), bindparam("b_at"))
    .where(Job.id == bindparam("b_job"), Job.status == JobStatus.QUEUED))


def record(db: Session, placed: Sequence[Placed], *, number: int) -> list[Placed]:
    """Write the assignments and take their devices' holds, all in one transaction where none raced (else one by
    one); returns those recorded. The compare-and-set: a job still queued (INSERT … SELECT … WHERE status) and
    not assigned already (the primary key), its devices held by no one (the holds' key). Commits."""
    if not placed:
        return []
    try:
        done = _record(db, placed, number)
        db.commit()
        return done
    except IntegrityError:
        db.rollback()
    out = []
    for p in placed:
        try:
            out.extend(_record(db, [p], number))
            db.commit()
        except IntegrityError:  # assigned by another pass, or a device taken since (a gang's node task)
            db.rollback()
            log.info("job %s: not assigned to %s (assigned already, or its devices taken)", p.job_id, p.worker_id)
    return out


def _record(db: Session, placed: Sequence[Placed], number: int) -> list[Placed]:
    now = utcnow()
    db.execute(_RECORD, [{"b_job": p.job_id, "b_worker": p.worker_id, "b_pass": number, "b_at": now,
                          "b_devices": list(p.devices) if p.devices is not None else None} for p in placed])
    landed = set(db.scalars(select(Assignment.job_id).where(Assignment.pass_no == number,
                                                            Assignment.job_id.in_([p.job_id for p in placed]))))
    done = [p for p in placed if p.job_id in landed]
    holds.take_many(db, [(p.worker_id, p.job_id, 0, list(p.devices)) for p in done if p.devices])
    return done
