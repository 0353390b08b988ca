"""Admitting a job: every check of a submission, the row committed, then the queue entry. The one path by which
a job is made, whether submitted, cloned or a sweep's trial."""

import logging
from collections.abc import MutableMapping

from redis.exceptions import RedisError

from service.auth.limits import check_submission
from service.errors import InvalidRequest, NotFound
from service.jobs import queue, service
from service.jobs.models import Job
from service.packages import service as packages
from service.scheduling import service as scheduling
from service.workers import service as worker_rows
from trainjobs import paths
from trainjobs.spec import JobSpec

log = logging.getLogger(__name__)


def admit(spec: JobSpec, *, db, redis, settings, principal, idempotency_key: str | None,
          cloned_from: str | None = None, trial: service.Trial | None = None,
          needs: MutableMapping[str, scheduling.Req] | None = None) -> tuple[Job, bool]:
    """(job, created): created False when an earlier request with the same Idempotency-Key made it (then
    nothing is enqueued: were that job lost from Redis, the reconciler enqueues it).

    `needs`: the process's kept needs of jobs (scheduling.snapshot's cache, app.state.job_needs): the new job's
    is put there, from the spec in hand, so this process's sweeper does not read and parse it again."""
    owner = principal.user
    job = service.find_by_key(db, spec=spec, idempotency_key=idempotency_key, owner=owner) if idempotency_key else None
    if job is not None:
        return job, False
    check_submission(db, redis, settings, principal, spec)
    if spec.entrypoint is not None and spec.entrypoint.package is not None:  # the owner's own, or a 404
        packages.get(db, owner=owner, digest=spec.entrypoint.package, field="entrypoint.package")
    service.check_inputs(spec, data_dir=settings.data_dir)
    if spec.init_from is not None:
        check_init_from(db, spec, principal=principal, storage_dir=settings.resolved_storage_dir)
    worker_rows.check_pip(db, spec=spec, lost_after_s=settings.lease_s)
    workers = worker_rows.memory_for(db, spec=spec, lost_after_s=settings.lease_s)
    job, created = service.create_once(db, spec=spec, idempotency_key=idempotency_key, owner=owner,
                                       workers=workers, cloned_from=cloned_from, trial=trial)
    if not created:
        return job, False
    if needs is not None:
        needs[job.id] = scheduling.req_of(job.spec, job.plan)
    try:
        queue.enqueue(redis, prefix=settings.queue_prefix, job_id=job.id, priority=job.priority,
                      timeout_s=spec.timeout_s)
    except RedisError:
        # Accepted all the same: the sweeper's reconcile pass enqueues it once Redis is back.
        log.exception("enqueue of job %s failed; the reconciler will retry", job.id)
    return job, True


def check_init_from(db, spec: JobSpec, *, principal, storage_dir) -> None:
    """The job to start from is the caller's (or any, for an admin: else 404) and has the weights asked for."""
    source = db.get(Job, spec.init_from.job)
    if source is None or not (principal.is_admin or source.owner == principal.user):
        raise NotFound(f"init_from.job {spec.init_from.job!r} not found", field="init_from.job")
    if paths.init_source(storage_dir, source.id, spec.init_from.checkpoint) is None:
        what = "final model (artifacts/model.pt)" if spec.init_from.checkpoint == "final" else "complete checkpoint"
        raise InvalidRequest(f"init_from.job {source.id} ({source.status}) has no {what}", field="init_from.job")
