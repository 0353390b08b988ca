"""The only module that talks to RQ: enqueue, drop, reconcile with the database."""

import logging
from datetime import timedelta

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Job
from service.jobs.status import JobStatus

log = logging.getLogger(__name__)

# The worker's job function, by dotted name: the control plane never imports worker/.
JOB_FUNCTION = "worker.agent.run_job"
PRIORITIES = ("high", "normal", "low")
# RQ must never kill a job before our supervisor does (it enforces timeout_s and the grace period).
RQ_TIMEOUT_MARGIN_S = 600


def queue_names(prefix: str) -> list[str]:
    """Queue names in the order a worker serves them."""
    return [f"{prefix}-{p}" for p in PRIORITIES]


def get_queue(redis: Redis, prefix: str, priority: str) -> Queue:
    return Queue(f"{prefix}-{priority}", connection=redis, serializer=JSONSerializer)


def enqueue(redis: Redis, *, prefix: str, job_id: str, priority: str, timeout_s: float) -> None:
    """Put a committed job on its priority queue; the RQ job id is our job id."""
    get_queue(redis, prefix, priority).enqueue_call(
        JOB_FUNCTION,
        args=[job_id],
        job_id=job_id,
        timeout=int(timeout_s) + RQ_TIMEOUT_MARGIN_S,
        result_ttl=3600,
        failure_ttl=24 * 3600,
        description=f"trainjobs job {job_id}",
    )


def drop(redis: Redis, *, prefix: str, job_id: str, priority: str) -> None:
    """Remove a job from its queue (a cancel of a queued job); a no-op if it is gone."""
    get_queue(redis, prefix, priority).remove(job_id)
    try:
        RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer).delete()
    except NoSuchJobError:
        pass


def reconcile(db: Session, redis: Redis, *, prefix: str, min_age_s: float = 10.0) -> list[str]:
    """Re-enqueue every queued job that no RQ queue holds (Redis lost it, or enqueue failed).

    Jobs queued in the last `min_age_s` are left alone: their API request may still be enqueueing them.
    """
    cutoff = utcnow() - timedelta(seconds=min_age_s)
    held: set[str] = set()
    for priority in PRIORITIES:
        held.update(get_queue(redis, prefix, priority).get_job_ids())
    missing = []
    for job in db.scalars(select(Job).where(Job.status == JobStatus.QUEUED, Job.queued_at <= cutoff)):
        if job.id not in held:
            enqueue(redis, prefix=prefix, job_id=job.id, priority=job.priority,
                    timeout_s=job.spec.get("timeout_s", 3600))
            missing.append(job.id)
    if missing:
        log.warning("re-enqueued %d queued job(s) missing from Redis: %s", len(missing), missing)
    return missing
