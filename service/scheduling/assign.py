"""The scheduler's pass, its database side (issue 42, step 5): one plan places queued jobs on workers and devices.

The control plane plans the pool once per pass (policy.plan, on the snapshot service.py reads); for each job the
plan starts now, this module picks its devices on the worker the plan gives it (placement.choose, keeping off the
devices the plan keeps for other jobs: a reservation's, a forming gang's), records the assignment (a
compare-and-set on the job still queued and unassigned: assignments.py) and takes the devices' holds in the same
transaction, so the next pass sees them used. A gang gets every node at once: node r on the plan's r-th worker,
all recorded in one transaction or none (a node whose devices are not free now keeps the whole gang waiting). The
queue side (node 0's entry moved onto its worker's own queue; nodes 1.. handed to theirs once node 0 claimed the
job) and the loop are service/jobs/assigner.py's; the worker only checks that what it is given still fits.

It also says what becomes of the assignments of earlier passes (`verdict`): a claimed job's is done, one unclaimed
after two passes or whose worker is lost is undone and planned again (a gang's: every node, all or none).
"""

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import JSON, Integer, bindparam, delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Attempt, Job
from service.scheduling import placement, policy
from service.scheduling import service as scheduling
from service.scheduling.assignments import Assignment
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Worker
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
UNCLAIMED_PASSES = 2  # passes an assignment may wait on its worker's queue before it is planned again


@dataclass(frozen=True)
class Placed:
    """A node of a job this pass assigned: on `worker_id`, on `devices` (None: the whole worker, devices unknown)."""

    job_id: str
    priority: str
    worker_id: str
    devices: tuple[int, ...] | None
    node_rank: int = 0


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
    started_at: datetime | None = None  # the job's claim (a gang's node 0): when nodes 1.. were handed over
    joined: bool = False  # a gang's node r: its attempt row of the claimed attempt exists (it joined)


def open_assignments(db: Session) -> list[Open]:
    a = Assignment
    joined = select(Attempt.id).where(Attempt.job_id == a.job_id, Attempt.number == a.attempt + 1,
                                      Attempt.node_rank == a.node_rank).exists()
    rows = db.execute(select(a.job_id, a.node_rank, a.worker_id, a.devices, a.attempt, a.pass_no, a.assigned_at,
                             a.taken_at, Job.status, Job.attempt, Job.priority, Job.started_at,
                             (a.node_rank > 0) & joined)
                      .outerjoin(Job, Job.id == a.job_id)).all()
    return [Open(job, node, worker, tuple(devices) if devices is not None else None, attempt, number, at, taken,
                 status, job_attempt, priority, started, bool(node_joined))
            for job, node, worker, devices, attempt, number, at, taken, status, job_attempt, priority, started,
            node_joined in rows]


def of_job(db: Session, job_id: str) -> list[Open]:
    """Every node's assignment of one job (the job's fields unset)."""
    a = Assignment
    return [Open(job_id, o.node_rank, o.worker_id, tuple(o.devices) if o.devices is not None else None, o.attempt,
                 o.pass_no, o.assigned_at, o.taken_at, None, None, None)
            for o in db.scalars(select(a).where(a.job_id == job_id).order_by(a.node_rank))]


def verdict(row: Open, *, number: int, live: Collection[str], on_priority_queue: Collection[str], now: datetime,
            unclaimed_s: float) -> str | None:
    """What becomes of an earlier assignment (None: it stands):

    - "claimed": its job left `queued` through a claim (its attempt moved on): the row is done;
    - "ended": its job left `queued` unclaimed (cancelled, gone): its holds and its entry go;
    - "given back": its entry is on a priority queue again (the worker gave it back, or its claim put it back);
    - "lost": its worker is no longer live;
    - "unclaimed": UNCLAIMED_PASSES passes (and `unclaimed_s`) went by and no claim came: planned again, unless its
      worker took it (`taken_at`) and is claiming it (the caller's: it stands holds.PENDING_S at most).

    A gang's node 1.. follows node 0 while the job waits to be claimed, then `node_verdict`.
    """
    if row.node_rank > 0:
        return node_verdict(row, number=number, live=live, now=now, unclaimed_s=unclaimed_s)
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


def node_verdict(row: Open, *, number: int, live: Collection[str], now: datetime, unclaimed_s: float) -> str | None:
    """A gang's node r ≥ 1 (None: it stands): before node 0's claim it stands with the job (node 0's row decides,
    and its undoing undoes every node); once node 0 claimed the job (its attempt is this one's + 1) its entry is on
    its worker's queue and it is "claimed" once the node joined, "ended" if the gang moved on without it (formed
    never, released, cancelled), and "lost" or "unclaimed" as node 0's would be, counted from the claim."""
    if row.status is None:
        return "ended"
    if row.job_attempt == row.attempt:
        return None if row.status == JobStatus.QUEUED else "ended"
    if row.job_attempt != row.attempt + 1:
        return "ended"
    if row.joined:
        return "claimed"
    if row.status != JobStatus.STARTING:
        return "ended"
    if row.worker_id not in live:
        return "lost"
    since = row.started_at or row.assigned_at
    if number - row.pass_no >= UNCLAIMED_PASSES and (now - since).total_seconds() >= unclaimed_s:
        return "unclaimed"
    return None


def misfit(db: Session, row: Assignment) -> str | None:
    """Why an assignment no longer fits its worker: a device of it unhealthy (as its heartbeat last said) or no
    longer held for its job; None when it fits."""
    if row.devices is None:
        return None
    health = {d["index"]: d.get("healthy", True) for d in workers.device_rows(db, worker_id=row.worker_id)}
    sick = [d for d in row.devices if not health.get(d, True)]
    if sick:
        return f"device(s) {sick} of {row.worker_id} turned unhealthy"
    held = holds.held(db, worker_id=row.worker_id)
    lost = [d for d in row.devices if held.get(d, (None, None))[0] != row.job_id]
    return f"device(s) {lost} of {row.worker_id} are no longer held for it" if lost else None


def forget(db: Session, row: Open, *, release: bool) -> None:
    """Delete an assignment (the caller commits); `release`: its devices' unclaimed holds go back too."""
    db.execute(delete(Assignment).where(Assignment.job_id == row.job_id, Assignment.node_rank == row.node_rank))
    if release:
        holds.release_pending(db, worker_id=row.worker_id, job_id=row.job_id, node_rank=row.node_rank)


def for_pass(snap: policy.Snapshot, *, standing: Sequence[Open]) -> policy.Snapshot:
    """The snapshot this pass plans: the queued jobs none assigned already (one being claimed is); and an
    assignment that holds no devices (its worker's devices unknown) still fills its worker. A job with no entry on
    a priority queue (lost with Redis until the reconciler enqueues it again, or before its submission's enqueue)
    is planned, so its reason, its place and its reservation show, but not assigned (`placements`). A forming
    gang's nodes assigned and not joined yet count as on their workers: the plan holds no other worker for them."""
    assigned = {o.job_id for o in standing}
    needs = {w.id: w.need.slots for w in snap.waiting} | {r.id: r.slots for r in snap.running}
    bare: dict[str, tuple[str, int]] = {}
    joining: dict[str, list[str]] = {}
    for o in standing:
        if o.devices is None:
            job, slots = bare.get(o.worker_id, (o.job_id, 0))
            bare[o.worker_id] = (job, slots + needs.get(o.job_id, 1))
        if o.node_rank > 0 and not o.joined and o.status == JobStatus.STARTING:
            joining.setdefault(o.job_id, []).append(o.worker_id)
    nodes = []
    for node in snap.nodes:
        if node.id in bare:
            job, slots = bare[node.id]
            node = dataclasses.replace(node, running=node.running or job) if node.room is None else \
                dataclasses.replace(node, room=max(0, node.room - slots))
        nodes.append(node)
    running = [dataclasses.replace(r, workers=(*r.workers, *(w for w in joining[r.id] if w not in r.workers)))
               if r.id in joining else r for r in snap.running]
    return dataclasses.replace(snap, nodes=nodes, running=running,
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

    def give_back(self, placed: Sequence[Placed]) -> None:
        """The devices of nodes placed a moment ago, free again (their gang does not start this pass)."""
        for p in placed:
            if p.devices:
                self.free[p.worker_id].update(p.devices)


def placements(db: Session, snap: policy.Snapshot, plan: policy.Plan, *, entries: Collection[str]) -> list[Placed]:
    """The nodes of the jobs the plan starts now that wait on a priority queue (`entries`: the pass moves their
    entry): node r on the plan's r-th worker (a gang: one node a worker), with the devices placement picks there;
    a gang only whole."""
    starting = [p for p in plan.order if p.workers and p.reason is None and p.job_id in entries]
    devices = _Devices(db, plan, snap, {w for p in starting for w in p.workers})
    out = []
    for p in starting:
        job = devices.waiting.get(p.job_id)
        if job is None or len(p.workers) < job.need.nodes:
            continue
        nodes = []
        for rank, worker_id in enumerate(p.workers[:job.need.nodes]):
            chosen = devices.take(worker_id, job)
            if chosen is False:
                log.info("job %s: too few devices free on %s now; it waits for the next pass", job.id, worker_id)
                devices.give_back(nodes)
                break
            nodes.append(Placed(job.id, job.priority, worker_id, chosen, rank))
        else:
            out.extend(nodes)
    return out


_RECORD = insert(Assignment.__table__).from_select(
    ["job_id", "node_rank", "worker_id", "devices", "attempt", "pass_no", "assigned_at"],
    select(Job.id, bindparam("b_node", type_=Integer), bindparam("b_worker"),
           bindparam("b_devices", type_=JSON(none_as_null=True)),
           Job.attempt, bindparam("b_pass"), bindparam("b_at"))
    .where(Job.id == bindparam("b_job"), Job.status == JobStatus.QUEUED))


def record(db: Session, placed: Sequence[Placed], *, number: int) -> list[Placed]:
    """Write the assignments and take their devices' holds, all in one transaction where none raced (else job by
    job: a gang's nodes together); returns those recorded. The compare-and-set: a job still queued (INSERT …
    SELECT … WHERE status) and not assigned already (the primary key), its devices held by no one (the holds'
    key). Commits."""
    if not placed:
        return []
    try:
        done = _record(db, placed, number)
        db.commit()
        return done
    except IntegrityError:
        db.rollback()
    by_job: dict[str, list[Placed]] = {}
    for p in placed:
        by_job.setdefault(p.job_id, []).append(p)
    out = []
    for job_id, nodes in by_job.items():
        try:
            out.extend(_record(db, nodes, number))
            db.commit()
        except IntegrityError:  # assigned by another pass, or a device taken since
            db.rollback()
            log.info("job %s: not assigned to %s (assigned already, or its devices taken)", job_id,
                     [p.worker_id for p in nodes])
    return out


def _record(db: Session, placed: Sequence[Placed], number: int) -> list[Placed]:
    now = utcnow()
    db.execute(_RECORD, [{"b_job": p.job_id, "b_node": p.node_rank, "b_worker": p.worker_id, "b_pass": number,
                          "b_at": now, "b_devices": list(p.devices) if p.devices is not None else None}
                         for p in placed])
    landed = {(job, node) for job, node in db.execute(select(Assignment.job_id, Assignment.node_rank).where(
        Assignment.pass_no == number, Assignment.job_id.in_({p.job_id for p in placed})))}
    done = [p for p in placed if (p.job_id, p.node_rank) in landed]
    holds.take_many(db, [(p.worker_id, p.job_id, p.node_rank, list(p.devices)) for p in done if p.devices])
    return done
