"""What the sweeper writes about queued jobs: why each one waits (from the scheduler's plan), the preemptions the plan
asks for, and priority aging so `low` never starves."""

import logging
from collections.abc import MutableMapping
from datetime import timedelta

from redis import Redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import queue
from service.jobs import service as jobs
from service.jobs.models import Job
from service.scheduling import policy
from service.scheduling import service as scheduling
from service.settings import Settings
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
SCAN = 500  # queued jobs looked at per pass, oldest first
UP = {"low": "normal", "normal": "high"}


def explain(db: Session, settings: Settings, cache: MutableMapping[str, scheduling.Req] | None = None) -> policy.Plan:
    """Plan the pool (service/scheduling/policy.py) and write what the sweeper owns of it: each queued job's
    pending_reason (None once it is about to start) and the preemptions. The caller commits; `cache` is the
    caller's, kept between passes (scheduling.snapshot)."""
    plan = policy.plan(scheduling.snapshot(db, settings, cache=cache))
    scheduling.apply(db, plan)
    return plan


def age(db: Session, redis: Redis, *, prefix: str, aging_s: float) -> list[str]:
    """A job queued longer than aging_s moves up one priority (low → normal → high), by compare-and-set.

    Its wait restarts at the new level, so `low` reaches `high` after twice aging_s. Its queue entry moves
    with it (after the commit: the row is the truth, the entry only a hint the reconciler can rebuild).
    """
    cutoff = utcnow() - timedelta(seconds=aging_s)
    moved = []
    for job_id, priority, spec in db.execute(select(Job.id, Job.priority, Job.spec).where(
            Job.status == JobStatus.QUEUED, Job.priority.in_(list(UP)), Job.queued_at <= cutoff).limit(SCAN)):
        done = db.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED,
                                            Job.priority == priority, Job.queued_at <= cutoff)
                          .values(priority=UP[priority], queued_at=utcnow())).rowcount
        if done:
            jobs.record_event(db, job_id=job_id, kind="aged",
                              detail=f"waited over {aging_s:g}s: priority {priority} → {UP[priority]}")
            moved.append((job_id, priority, spec.timeout_s))
    db.commit()
    for job_id, priority, timeout_s in moved:
        old = queue.get_queue(redis, prefix, priority)
        if old.remove(job_id):  # else a worker has it, or the reconciler will enqueue it at its new level
            queue.enqueue(redis, prefix=prefix, job_id=job_id, priority=UP[priority], timeout_s=timeout_s)
    if moved:
        log.info("aged %d queued job(s) up one priority: %s", len(moved), [m[0] for m in moved])
    return [m[0] for m in moved]
