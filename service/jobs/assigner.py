"""The one scheduler (issue 42, step 5): a pass in the control plane plans the pool once and assigns jobs to workers.

One API process at a time (a Redis lock of its own, as the sweeper's) runs a pass when kicked (a job queued,
devices freed, a worker ready: queue.kick) or every sweep_s:

1. earlier assignments settled (scheduling/assign.py `verdict`): a claimed job's row is done; one unclaimed after
   two passes, whose worker is lost or that was given back is undone (its unclaimed holds released, its entry
   back at the head of its priority queue) and planned again;
2. one `policy.plan` on the pool's snapshot (the queued jobs none assigned; only those with an entry on a priority
   queue are assigned);
3. each job it starts now: its devices picked, its assignment and holds written (one transaction, a
   compare-and-set), then its entry moved from its priority queue onto its worker's own queue (one Lua step);
4. the same plan's pending reasons, estimates and preemptions written (jobs/pending.py `apply`; every sweep_s,
   not at each kick), and its queue view stored in Redis for GET /v1/queue (scheduling/queue_view.py; every pass).

Workers read no pool and run no plan: a lane pops its worker's own queue and only checks that the job still fits
(service/runners/assign_calls.py). The claim's compare-and-set still decides who runs a job.
"""

import logging
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, utcnow
from service.jobs import pending, queue
from service.scheduling import assign, policy, queue_view
from service.scheduling import service as scheduling
from service.settings import Settings
from service.workers import holds
from service.workers import service as workers

log = logging.getLogger(__name__)
PASS_KEY = "{prefix}:assign:pass"  # the pass counter, shared by the API processes
LOCK_KEY = "{prefix}:assigner"


@dataclass
class Report:
    """What one pass did, and how long its parts took (bench/assign_pass.py prints them)."""

    number: int = 0
    assigned: list[assign.Placed] = field(default_factory=list)
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
    moved = queue.hand_to_workers(redis, prefix=prefix, moves=[(p.job_id, p.priority, p.worker_id) for p in recorded])
    for p, ok in zip(recorded, moved, strict=True):
        if ok:
            report.assigned.append(p)
            log.info("pass %d: job %s assigned to %s, device(s) %s", report.number, p.job_id, p.worker_id,
                     list(p.devices) if p.devices is not None else "all")
        else:  # its entry left its queue since it was read: nothing to run there; the next pass sees it again
            assign.forget(db, _open(p, report.number), release=True)
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
    """Earlier passes' assignments: done, undone or standing (returned)."""
    prefix, now, standing = settings.queue_prefix, utcnow(), []
    for row in assign.open_assignments(db):
        why = assign.verdict(row, number=report.number, live=live, on_priority_queue=entries, now=now,
                             unclaimed_s=unclaimed_s)
        if why is None:
            standing.append(row)
            continue
        if why != "claimed":
            waited = queue.off_worker_queue(redis, prefix=prefix, job_id=row.job_id, worker_id=row.worker_id)
            if why == "unclaimed" and not waited and row.taken_at is not None:
                if (now - row.taken_at).total_seconds() < holds.PENDING_S:
                    standing.append(row)  # its worker took it off its queue and is claiming it
                    continue
                why = "taken, never claimed"
        assign.forget(db, row, release=why != "claimed")
        db.commit()
        if why in ("lost", "unclaimed", "taken, never claimed"):  # planned again: its entry back, its hash anew
            if queue.put_back(db, redis, prefix=prefix, job_id=row.job_id):
                entries[row.job_id] = row.priority  # this pass plans it too
        if why != "claimed":
            report.undone[row.job_id] = why
            log.info("pass %d: the assignment of job %s to %s is undone (%s)", report.number, row.job_id,
                     row.worker_id, why)
    return standing


def _open(p: assign.Placed, number: int) -> assign.Open:
    return assign.Open(p.job_id, 0, p.worker_id, p.devices, 0, number, utcnow(), None, None, None, p.priority)


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
