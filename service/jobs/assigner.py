"""The one scheduler (issue 42, step 5): a pass in the control plane plans the pool once and assigns jobs to workers.

One API process at a time (a Redis lock of its own, as the sweeper's) runs a pass when kicked (a job queued,
devices freed, a worker ready: queue.kick) or every sweep_s:

1. earlier assignments settled (scheduling/assign.py `verdict`): a claimed job's row is done; one unclaimed after
   two passes, whose worker is lost or that was given back is undone (its unclaimed holds released, its entry
   back at the head of its priority queue) and planned again. A gang's nodes go together: one node undone undoes
   every node, and a gang forming on them is released (all nodes or none). A gang whose node 0 claimed the job
   gets its nodes 1.. handed to their workers' queues (`hand_nodes`; the claim kicks a pass for it);
2. one `policy.plan` on the pool's snapshot (the queued jobs none assigned; only those with an entry on a priority
   queue are assigned);
3. each job it starts now: every node's devices picked (a gang: node r on the plan's r-th worker), its
   assignments and holds written (one transaction, a compare-and-set), then its entry moved from its priority
   queue onto node 0's worker's own queue (one Lua step);
4. the same plan's pending reasons, estimates and preemptions written (jobs/pending.py `apply`; every sweep_s,
   not at each kick), and its queue view stored in Redis for GET /v1/queue (scheduling/queue_view.py; every pass).

Workers read no pool and run no plan: a lane pops its worker's own queue and only checks that the job (the node)
still fits (service/runners/assign_calls.py). The claim's and the gang join's compare-and-sets still decide who
runs a job.
"""

import logging
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from redis import Redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, utcnow
from service.jobs import lifecycle, pending, queue
from service.jobs.models import Job
from service.scheduling import assign, policy, queue_view
from service.scheduling import service as scheduling
from service.settings import Settings
from service.workers import holds
from service.workers import service as workers
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
PASS_KEY = "{prefix}:assign:pass"  # the pass counter, shared by the API processes
LOCK_KEY = "{prefix}:assigner"


@dataclass
class Report:
    """What one pass did, and how long its parts took (bench/assign_pass.py prints them)."""

    number: int = 0
    assigned: list[assign.Placed] = field(default_factory=list)  # each job's node 0 (its entry moved)
    nodes: list[assign.Placed] = field(default_factory=list)  # a gang's nodes 1.., assigned with its node 0
    handed: list[str] = field(default_factory=list)  # node tasks put on their workers' queues (node 0 claimed)
    undone: dict[str, str] = field(default_factory=dict)  # job -> why
    plan: policy.Plan | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def run_pass(db: Session, redis: Redis, settings: Settings, *, cache: MutableMapping[str, scheduling.Req],
             unclaimed_s: float | None = None, reasons: bool = True) -> Report:
    """One scheduling pass (the caller holds the assigner's lock). Commits as it goes. `reasons`: also write the
    plan's pending reasons and preemptions (the loop does every sweep_s, as the sweeper did)."""
    prefix = settings.queue_prefix
    report = Report(number=int(redis.incr(PASS_KEY.format(prefix=prefix))))
    t0 = time.perf_counter()
    entries = queue.priority_entries(redis, prefix)
    live = {w.id for w in workers.live(db, lost_after_s=settings.lease_s)}
    standing = settle(db, redis, settings, report, entries=entries, live=live,
                      unclaimed_s=settings.sweep_s if unclaimed_s is None else unclaimed_s)
    t1 = time.perf_counter()
    full = scheduling.snapshot(db, settings, cache=cache)
    snap = assign.for_pass(full, standing=standing)
    t2 = time.perf_counter()
    report.plan = plan = policy.plan(snap)
    t3 = time.perf_counter()
    placed = assign.placements(db, snap, plan, entries=entries)
    t4 = time.perf_counter()
    recorded = assign.record(db, placed, number=report.number)
    firsts = [p for p in recorded if p.node_rank == 0]
    moved = queue.hand_to_workers(redis, prefix=prefix, moves=[(p.job_id, p.priority, p.worker_id) for p in firsts])
    for p, ok in zip(firsts, moved, strict=True):
        nodes = [n for n in recorded if n.job_id == p.job_id and n.node_rank > 0]
        if ok:
            report.assigned.append(p)
            report.nodes.extend(nodes)
            log.info("pass %d: job %s assigned to %s", report.number, p.job_id, ", ".join(
                f"{n.worker_id} (node {n.node_rank}, device(s) {list(n.devices) if n.devices is not None else 'all'})"
                for n in (p, *nodes)))
        else:  # its entry left its queue since it was read: nothing to run there; the next pass sees it again
            for n in (p, *nodes):
                assign.forget(db, _open(n, report.number), release=True)
            db.commit()
    t5 = time.perf_counter()
    if reasons:
        pending.apply(db, plan)
        db.commit()
    t6 = time.perf_counter()
    view = queue_view.render(full, plan, policy_name=settings.scheduler_policy, planned_by="pass",
                             number=report.number, assigned=[o.job_id for o in standing if o.node_rank == 0])
    queue_view.store(redis, prefix=prefix, view=view, ttl_s=queue_view.ttl_of(settings))
    t7 = time.perf_counter()
    report.seconds = {"settle": t1 - t0, "snapshot": t2 - t1, "plan": t3 - t2, "place": t4 - t3,
                      "assign": t5 - t4, "reasons": t6 - t5, "view": t7 - t6}
    return report


def settle(db: Session, redis: Redis, settings: Settings, report: Report, *, entries: dict[str, str],
           live: set[str], unclaimed_s: float) -> list[assign.Open]:
    """Earlier passes' assignments: done, undone or standing (returned). An undone node of a gang undoes the
    gang's every node (all or none); a gang's node whose job node 0 claimed is handed to its worker."""
    prefix, now, standing, gone = settings.queue_prefix, utcnow(), [], set()
    for row in assign.open_assignments(db):
        if row.job_id in gone:
            continue
        why = assign.verdict(row, number=report.number, live=live, on_priority_queue=entries, now=now,
                             unclaimed_s=unclaimed_s)
        if why is None:
            standing.append(row)
            continue
        if why not in ("claimed", "ended"):
            waited = queue.off_worker_queue(redis, prefix=prefix, entry=entry_of(row), worker_id=row.worker_id)
            if why == "unclaimed" and not waited and row.taken_at is not None:
                if (now - row.taken_at).total_seconds() < holds.PENDING_S:
                    standing.append(row)  # its worker took it off its queue and is claiming (joining) it
                    continue
                why = "taken, never claimed"
        if why == "claimed":
            assign.forget(db, row, release=False)
            db.commit()
            continue
        # Undone: every node of its job goes (a gang forming on them is let go), and it is planned again.
        gone.add(row.job_id)
        again = why != "given back"  # given back: its entry is on its priority queue already
        why = why if row.node_rank == 0 else f"node {row.node_rank} on {row.worker_id}: {why}"
        if undo_job(db, redis, prefix=prefix, job_id=row.job_id, why=why, put_back=again):
            entries[row.job_id] = row.priority or "normal"  # this pass plans it too
        report.undone[row.job_id] = why
        log.info("pass %d: the assignment of job %s is undone (%s)", report.number, row.job_id, why)
    standing = [o for o in standing if o.job_id not in gone]
    report.handed = hand_nodes(db, redis, prefix=prefix, standing=standing)
    return standing


def entry_of(row: assign.Open) -> str:
    """An assignment's queue entry: the job's (node 0), or the node task's of the attempt node 0 claimed."""
    return row.job_id if row.node_rank == 0 else queue.node_task_id(row.job_id, row.attempt + 1, row.node_rank)


def undo_job(db: Session, redis: Redis, *, prefix: str, job_id: str, why: str, put_back: bool = True) -> bool:
    """Every node's assignment of a job goes, with its unclaimed holds and its entry on its worker's queue; a gang
    still forming on them is released (lifecycle.release_gang: its joined nodes stop, no retry spent). `put_back`:
    its entry back on its priority queue, to be planned again (True when it is, the job still queued)."""
    rows = assign.of_job(db, job_id)
    job = db.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if job is not None and job.status == JobStatus.STARTING and any(r.attempt + 1 == job.attempt for r in rows):
        lifecycle.release_gang(db, job_id=job_id, attempt=job.attempt, why=f"its assignment was undone ({why})")
    for row in rows:
        assign.forget(db, row, release=True)
    db.commit()
    for row in rows:
        queue.off_worker_queue(redis, prefix=prefix, entry=entry_of(row), worker_id=row.worker_id)
        if row.node_rank > 0:
            queue.drop_node_task(redis, task_id=entry_of(row))
    return put_back and queue.put_back(db, redis, prefix=prefix, job_id=job_id)


def hand_nodes(db: Session, redis: Redis, *, prefix: str, standing: list[assign.Open]) -> list[str]:
    """The node tasks of gangs whose node 0 claimed the job, on their workers' queues (those not there yet)."""
    nodes = [o for o in standing if o.node_rank > 0 and o.status == JobStatus.STARTING
             and o.job_attempt == o.attempt + 1 and not o.joined]
    if not nodes:
        return []
    timeouts = {j: spec.timeout_s for j, spec in db.execute(select(Job.id, Job.spec).where(
        Job.id.in_({o.job_id for o in nodes})))}
    handed = queue.hand_nodes(redis, prefix=prefix, nodes=[(o.job_id, o.attempt + 1, o.node_rank, o.worker_id,
                                                            timeouts.get(o.job_id, 0.0)) for o in nodes])
    for task in handed:
        log.info("node task %s handed to its worker's queue", task)
    return handed


def _open(p: assign.Placed, number: int) -> assign.Open:
    return assign.Open(p.job_id, p.node_rank, p.worker_id, p.devices, 0, number, utcnow(), None, None, None,
                       p.priority)


class Assigner:
    """The pass's loop in a thread of the API: waits for a kick (at most sweep_s), then runs a pass under the
    assigner's Redis lock; an API process that does not hold it waits for the next kick."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], redis: Redis,
                 cache: MutableMapping[str, scheduling.Req] | None = None):
        self.settings, self.sessions, self.redis = settings, sessions, redis
        self.cache: MutableMapping[str, scheduling.Req] = {} if cache is None else cache
        self.last: Report | None = None
        self.reasons_at = -float("inf")  # when a pass last wrote the pending reasons and preemptions

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            try:
                queue.wait_for_kick(self.redis, prefix=self.settings.queue_prefix,
                                    timeout_s=min(self.settings.sweep_s, 2.0))
            except Exception:  # noqa: BLE001 - Redis away: the next tick says so; wait as a tick would
                stop.wait(self.settings.sweep_s)

    def tick(self) -> Report | None:
        prefix = self.settings.queue_prefix
        lock = self.redis.lock(LOCK_KEY.format(prefix=prefix), timeout=max(10.0, self.settings.sweep_s * 5))
        try:
            if not lock.acquire(blocking=False):
                return None
        except Exception:  # noqa: BLE001 - Redis down: nothing to assign against; try again later
            log.warning("the scheduler cannot reach Redis; will retry")
            return None
        try:
            # NOTE: a kicked pass (a submission) assigns at once; the reasons and preemptions are written every
            # sweep_s, as the sweeper did: a job's row (its ETag) does not change a moment after its submission.
            now = time.monotonic()
            reasons = now - self.reasons_at >= self.settings.sweep_s
            with self.sessions() as db:
                self.last = run_pass(db, self.redis, self.settings, cache=self.cache, reasons=reasons)
            if reasons:
                self.reasons_at = now
            return self.last
        except UNREACHABLE as exc:
            log.warning("the scheduler cannot reach the database (%s); will retry", type(exc).__name__)
        except Exception:  # noqa: BLE001 - a failed pass must not stop the loop
            log.exception("scheduling pass failed")
        finally:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - expired or Redis gone: the next pass takes it again
                pass
        return None
