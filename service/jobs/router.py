import logging
from typing import Annotated

from fastapi import APIRouter, Query, Response
from redis.exceptions import RedisError

from service import queue, workers_registry
from service.deps import RedisDep, SessionDep, SettingsDep
from service.jobs import service
from service.jobs.schemas import JobPublic, JobsPublic
from service.jobs.spec import JobSpec
from service.jobs.status import JobStatus

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=201, response_model=JobPublic)
def submit_job(spec: JobSpec, response: Response, db: SessionDep, redis: RedisDep, settings: SettingsDep):
    """Store the job, commit, then enqueue: the row is the truth, the queue entry only a hint."""
    service.check_inputs(spec, data_dir=settings.data_dir)
    workers = workers_registry.workers_for(redis, prefix=settings.queue_prefix, spec=spec)
    job = service.create(db, spec=spec, workers=workers)
    db.commit()
    try:
        queue.enqueue(redis, prefix=settings.queue_prefix, job_id=job.id, priority=job.priority,
                      timeout_s=spec.timeout_s)
    except RedisError:
        # Accepted all the same: the sweeper's reconcile pass enqueues it once Redis is back.
        log.exception("enqueue of job %s failed; the reconciler will retry", job.id)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobPublic.of(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    db: SessionDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
):
    jobs, next_cursor = service.list_jobs(db, status=status, limit=limit, cursor=cursor)
    return JobsPublic(items=[JobPublic.of(j) for j in jobs], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobPublic)
def read_job(job_id: str, db: SessionDep):
    return JobPublic.of(service.get(db, job_id=job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: str, db: SessionDep, redis: RedisDep, settings: SettingsDep):
    """A queued job is cancelled at once; a running one once its supervisor has killed every process."""
    job, was_queued = service.request_cancel(db, job_id=job_id)
    if was_queued:
        try:
            queue.drop(redis, prefix=settings.queue_prefix, job_id=job.id, priority=job.priority)
        except RedisError:
            log.warning("could not drop cancelled job %s from Redis; the worker will skip it", job.id)
    return JobPublic.of(job)
