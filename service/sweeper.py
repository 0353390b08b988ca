"""The sweeper inside the API: lost workers, retries due, and the queue rebuilt from the database.

One pass at a time across API replicas (a Redis lock). Every change it makes is the same
compare-and-set a worker would make, so a worker that wakes up late finds its job gone and stops.
"""

import logging
import threading
import time

from redis import Redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service import queue
from service.db import utcnow
from service.jobs import retries
from service.jobs.models import Attempt, Job
from service.settings import Settings
from service.workers import pending
from service.workers import service as workers
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)


def expire_leases(db: Session) -> list[str]:
    """Attempts whose worker stopped renewing: the attempt is lost; the job is retried or failed."""
    now = utcnow()
    rows = db.execute(
        select(Attempt.job_id, Attempt.number, Attempt.node_rank, Attempt.worker, Attempt.lease_expires_at,
               Job.status)
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.status == "active", Attempt.lease_expires_at < now, Job.attempt == Attempt.number,
               Job.status.in_([JobStatus.STARTING, JobStatus.RUNNING]))
    ).all()
    settled = []
    for job_id, number, node_rank, worker, expired, job_status in rows:
        late = (now - expired).total_seconds()
        message = f"worker {worker} stopped renewing its lease ({late:.1f}s past expiry)"
        if _forming_gang(db, job_id, job_status):
            # A gang still forming has run nothing: it lets its other nodes go, and no retry is spent.
            if retries.release_gang(db, job_id=job_id, attempt=number, why=f"node {node_rank}: {message}"):
                settled.append(job_id)
                log.warning("job %s attempt %s: worker %s lost while its gang formed; job queued", job_id,
                            number, worker)
            continue
        error = {"type": "worker_lost", "rank": None, "worker": worker, "node_rank": node_rank, "message": message}
        status = retries.settle_failure(db, job_id=job_id, attempt=number, error=error, attempt_status="lost",
                                        node_rank=node_rank)
        if status is not None:
            settled.append(job_id)
            log.warning("job %s attempt %s: worker %s lost; job %s", job_id, number, worker, status)
    db.commit()
    return settled


def _forming_gang(db: Session, job_id: str, status: str) -> bool:
    if status != JobStatus.STARTING:
        return False
    spec = db.scalar(select(Job.spec).where(Job.id == job_id))
    return (spec or {}).get("resources", {}).get("nnodes", 1) > 1


class Sweeper:
    """Runs in a thread of the API: leases and due retries every sweep_s, the full reconcile every reconcile_s."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], redis: Redis):
        self.settings, self.sessions, self.redis = settings, sessions, redis
        self.stop = threading.Event()
        # NOTE: after an outage of the database or Redis, wait one lease before declaring workers lost:
        # their renewals failed for the same reason, and they deserve the chance to renew first.
        self.healthy_since: float | None = None
        self.last_reconcile = -float("inf")

    def run(self) -> None:
        while not self.stop.is_set():
            self.tick()
            self.stop.wait(self.settings.sweep_s)

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
                    expire_leases(db)
                full = now - self.last_reconcile >= self.settings.reconcile_s
                pending.age(db, self.redis, prefix=self.settings.queue_prefix, aging_s=self.settings.aging_s)
                queue.reconcile(db, self.redis, prefix=self.settings.queue_prefix, min_age_s=10.0 if full else None)
                pending.explain(db, lost_after_s=self.settings.lease_s)
                if full:
                    workers.prune(db)
                    self.last_reconcile = now
                db.commit()
        except Exception:  # noqa: BLE001 - a failed pass must not stop the loop
            self.healthy_since = None
            log.exception("sweeper pass failed")
        finally:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - expired or Redis gone: the next pass takes it again
                pass
