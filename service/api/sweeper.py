"""The sweeper inside the API: lost workers, retries due, the queue rebuilt from the database, the sweeps'
trials (service/sweeps/controller.py), and the job counts' deltas folded (service/jobs/counts.py). Beside it, in a
thread of its own, the scheduler's pass (service/jobs/assigner.py): the one plan, which assigns jobs to workers and
writes the pending reasons and preemptions.

One pass at a time across API replicas (a Redis lock). Every change it makes is the same
compare-and-set a worker would make, so a worker that wakes up late finds its job gone and stops.
"""

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, utcnow
from service.jobs import counts, lifecycle, pending, queue, retention
from service.jobs.assigner import Assigner
from service.scheduling import service as scheduling
from service.settings import Settings
from service.storage import open_store
from service.sweeps import controller as sweeps
from service.workers import service as workers

log = logging.getLogger(__name__)
COLLECT_EVERY_S = 3600.0  # retention, when TRAINJOBS_RETENTION_DAYS is set
COLLECT_BATCHES = 5  # of retention.BATCH jobs, per sweeper pass (a 200-job batch of 200k points: 0.25 s here)


class Sweeper:
    """Runs in a thread of the API: leases and due retries every sweep_s, the full reconcile every reconcile_s."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], redis: Redis,
                 on_collect: Callable[[retention.Collected], object] | None = None,
                 needs: dict[str, scheduling.Req] | None = None):
        self.settings, self.sessions, self.redis = settings, sessions, redis
        self.on_collect = on_collect  # /metrics counts what retention deleted
        self.stop = threading.Event()
        # NOTE: after an outage of the database or Redis, wait one lease before declaring workers lost:
        # their renewals failed for the same reason, and they deserve the chance to renew first.
        self.healthy_since: float | None = None
        self.last_reconcile = -float("inf")
        self.last_collect = -float("inf")
        self.collect_after: str | None = None  # a collection under way goes on after this job id
        # Jobs' needs, parsed once (scheduling.snapshot's cache); the API's submissions put theirs there too.
        self.reqs: dict[str, scheduling.Req] = {} if needs is None else needs
        self.assigner = Assigner(settings, sessions, redis, cache=self.reqs)

    def run(self) -> None:
        """The sweeper's loop; the scheduler's pass runs beside it in a thread of its own, until `stop`."""
        assigning = threading.Thread(target=self.assigner.run, args=(self.stop,), name="assigner", daemon=True)
        assigning.start()
        try:
            while not self.stop.is_set():
                self.tick()
                self.stop.wait(self.settings.sweep_s)
        finally:
            assigning.join(timeout=5)

    def tick(self) -> None:
        lock = self.redis.lock(f"{self.settings.queue_prefix}:sweeper", timeout=max(10.0, self.settings.sweep_s * 5))
        try:
            if not lock.acquire(blocking=False):
                return
        except Exception:  # noqa: BLE001 - Redis down: nothing to sweep against; try again later
            self.healthy_since = None
            log.warning("sweeper cannot reach Redis; will retry")
            return
        try:
            now = time.monotonic()
            self.healthy_since = self.healthy_since or now
            with self.sessions() as db:
                if now - self.healthy_since >= self.settings.lease_s:
                    lifecycle.expire_leases(db)
                full = now - self.last_reconcile >= self.settings.reconcile_s
                pending.age(db, self.redis, prefix=self.settings.queue_prefix, aging_s=self.settings.aging_s)
                queue.reconcile(db, self.redis, prefix=self.settings.queue_prefix, min_age_s=10.0 if full else None)
                scheduling.fold_usage(db, half_life_s=self.settings.fair_share_half_life_s)
                if full:
                    workers.prune(db)
                    self.last_reconcile = now
                db.commit()
                sweeps.advance_all(db, self.redis, self.settings)  # trials made, stopped early; sweeps ended
                counts.compact(db)  # apart: a short transaction on the count rows
                db.commit()
                if self.settings.retention_days and (self.collect_after is not None
                                                     or now - self.last_collect >= COLLECT_EVERY_S):
                    # NOTE: a few batches a pass, going on where the last pass stopped: a pass stays short
                    # (the lock's timeout, and leases to expire), however many jobs a first collection meets.
                    done = retention.collect(db, cutoff=utcnow() - timedelta(days=self.settings.retention_days),
                                             storage_dir=self.settings.resolved_storage_dir,
                                             store=open_store(self.settings), after=self.collect_after or "",
                                             max_batches=COLLECT_BATCHES)
                    self.collect_after = done.resume_after
                    if done.resume_after is None:
                        self.last_collect = now
                    log.info("retention: %s", done.as_dict())
                    if self.on_collect is not None:
                        self.on_collect(done)
        except UNREACHABLE as exc:  # an outage: one line per pass, not a traceback
            self.healthy_since = None
            log.warning("sweeper cannot reach the database (%s); will retry", type(exc).__name__)
        except Exception:  # noqa: BLE001 - a failed pass must not stop the loop
            self.healthy_since = None
            log.exception("sweeper pass failed")
        finally:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - expired or Redis gone: the next pass takes it again
                pass
