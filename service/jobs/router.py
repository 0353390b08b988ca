import logging
import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from service.auth.deps import JobIdDep, PrincipalDep, visible_job
from service.auth.tokens import Principal
from service.deps import RedisDep, SessionDep, SettingsDep
from service.errors import GatewayTimeout, InvalidTransition, JobNotFound, responses
from service.jobs import admission, lifecycle, queue, records, service
from service.jobs.bodies import page_body
from service.jobs.etag import bytes_with_etag, job_etag, not_modified
from service.jobs.schemas import AttemptPublic, AttemptsPublic, JobPublic, JobsPublic
from service.lists import CursorQuery
from trainjobs.spec import JobSpec, with_overrides
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=128)]


# A job no live worker could run is refused at submission (a 422 or 403 naming what none has), unless the caller
# says it will wait for such a worker.
AllowUnschedulable = Annotated[bool, Query(description="take the job though no live worker could run it now: it "
                                           "waits, queued with a pending_reason, for one that can")]
REPLAYED = {200: {"model": JobPublic, "description": "a retry with the same Idempotency-Key: the first one's job"}}


@router.post("", status_code=201, response_model=JobPublic,
             responses=REPLAYED | responses(400, 403, 404, 409, 413, 429))
async def submit_job(spec: JobSpec, request: Request, principal: PrincipalDep,
                     idempotency_key: IdempotencyKey = None, allow_unschedulable: AllowUnschedulable = False
                     ) -> Response:
    """Store the job, commit, then enqueue: the row is the truth, the queue entry only a hint.

    A retry with the same Idempotency-Key and spec answers 200 with the job the first one made and enqueues
    nothing (were that job lost from Redis, the reconciler enqueues it). Concurrent submissions are admitted
    together (service/api/admitter.py).
    """
    answer = await request.app.state.admitter.admit(admission.Submission(spec, principal, idempotency_key,
                                                                         wait=allow_unschedulable))
    return created(answer.job_id, answer.version, answer.body, answer.created)


# NOTE: `:validate` (a custom method, as Google's APIs name them), not `/validate`: that would also match
# GET /v1/jobs/{job_id}.
@router.post(":validate", response_model=JobSpec, responses=responses(400, 403, 404, 413))
def validate_job(spec: JobSpec, db: SessionDep, settings: SettingsDep, principal: PrincipalDep,
                 allow_unschedulable: AllowUnschedulable = False) -> JobSpec:
    """A dry submit: the checks POST /v1/jobs makes of the spec (rights, inputs, the pool), and no job. 200 with the
    spec as a job would run it, or the refusal a submission would get. Not looked at: `entrypoint.package`
    (upload it once the spec passes, as `trainjobs run` does), the submission rate and the quota."""
    return admission.check(spec, db=db, settings=settings, principal=principal, wait=allow_unschedulable)


def created(job_id: str, version: int, body: bytes, new: bool) -> Response:
    """A submission's answer: the body is rendered once, kept for the job's version (the client's first poll finds
    it) and sent as bytes, with the version's ETag: FastAPI's response model would validate and encode it again."""
    return Response(body, status_code=201 if new else 200, media_type="application/json",
                    headers={"Location": f"/v1/jobs/{job_id}", "ETag": job_etag(version)})


def accept(spec: JobSpec, *, request: Request, db, redis, settings, principal, idempotency_key: str | None,
           cloned_from: str | None = None, wait: bool = False) -> Response:
    """Every check of a submission, the row committed, then the queue entry (a clone: one at a time)."""
    with db:  # closed in this thread
        job, new = admission.admit(spec, db=db, redis=redis, settings=settings, principal=principal,
                                   idempotency_key=idempotency_key, cloned_from=cloned_from,
                                   needs=request.app.state.job_needs, wait=wait)
        body = request.app.state.job_bodies.render(job)
    return created(job.id, job.version, body, new)


class CloneRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    set: dict[Annotated[str, Field(min_length=1, max_length=200)], Any] = Field(
        default_factory=dict, max_length=64, description='dotted spec paths and their new values, e.g. '
        '{"optimizer.lr": 0.0003, "train.seed": 1}')


@router.post("/{job_id}/clone", status_code=201, response_model=JobPublic,
             responses=REPLAYED | responses(400, 403, 404, 409, 413, 429))
def clone_job(job_id: JobIdDep, body: CloneRequest, request: Request, db: SessionDep, redis: RedisDep,
              settings: SettingsDep, principal: PrincipalDep, idempotency_key: IdempotencyKey = None,
              allow_unschedulable: AllowUnschedulable = False) -> Response:
    """A new job whose spec is this one's with `set` applied (checked as a submission is); it names its source
    (`cloned_from`). The source's strategy is the one it ran with (an "auto" was resolved when it was made)."""
    source = service.get(db, job_id=job_id)
    spec = with_overrides(source.spec, body.set)
    return accept(spec, request=request, db=db, redis=redis, settings=settings, principal=principal,
                  idempotency_key=idempotency_key, cloned_from=source.id, wait=allow_unschedulable)


@router.get("", response_model=JobsPublic)
def list_jobs(
    request: Request,
    db: SessionDep,
    principal: PrincipalDep,
    status: JobStatus | None = None,
    owner: Annotated[str | None, Query(max_length=64, description="admins only; users see their own")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: CursorQuery = None,
    name: Annotated[str | None, Query(min_length=1, max_length=128, description="names that start with it")] = None,
    tag: Annotated[str | None, Query(min_length=1, max_length=64, description="jobs that carry this tag")] = None,
    sweep: Annotated[str | None, Query(pattern=r"^[0-9a-f]{20}$", description="the trials of this sweep")] = None,
):
    owner = owner if principal.is_admin else principal.user
    bodies = request.app.state.job_bodies
    with db:  # closed in this thread (see read_job)
        page, next_cursor = service.list_page(db, status=status, limit=limit, cursor=cursor, owner=owner, name=name,
                                              tag=tag, sweep=sweep)
        found = {row.id: bodies.get(row.id, row.version) for row in page}
        for job in service.get_many(db, job_ids=[job_id for job_id, body in found.items() if body is None]):
            found[job.id] = bodies.render(job)  # NOTE: as it is now, if it changed since the page's read
    # A job gone since the page's read (retention deleted it) is left out.
    body = page_body((found[row.id] for row in page if found[row.id] is not None), next_cursor)
    return bytes_with_etag(request, body)


@router.get("/{job_id}", response_model=JobPublic, responses=responses(404))
async def read_job(job_id: str, request: Request, principal: PrincipalDep):
    """With an ETag: an If-None-Match that names the current one gets a 304 and no body.

    The ETag is the row's version, read with the owner check, on the event loop (service/api/loop_reads.py):
    a 304, or a 200 of a version this process rendered before, takes no thread and loads nothing more.
    """
    state = request.app.state
    if state.loop_reads is None:  # SQLite: the owner check in a session, in the threadpool
        return await run_in_threadpool(read_job_in_session, request, job_id, principal)
    head = await state.loop_reads.job_head(job_id) if len(job_id) <= 64 else None
    if head is None or not (principal.is_admin or head[0] == principal.user):
        raise JobNotFound(job_id)
    version = head[1]
    cached = not_modified(request, job_etag(version))
    if cached is not None:
        return cached
    body = state.job_bodies.get(job_id, version)
    if body is None:
        body, version = await run_in_threadpool(render_job, request, job_id)
    return bytes_with_etag(request, body, etag=job_etag(version))


def read_job_in_session(request: Request, job_id: str, principal: Principal) -> Response:
    with request.app.state.sessionmaker() as db:
        version = visible_job(db, job_id=job_id, principal=principal).version
        cached = not_modified(request, job_etag(version))
        if cached is not None:
            return cached
        body = request.app.state.job_bodies.get(job_id, version)
        if body is None:
            job = service.get(db, job_id=job_id)
            body, version = request.app.state.job_bodies.render(job), job.version
    return bytes_with_etag(request, body, etag=job_etag(version))


def render_job(request: Request, job_id: str) -> tuple[bytes, int]:
    """The job's body and the version it renders (a write since the owner check may have bumped it)."""
    with request.app.state.sessionmaker() as db:
        job = service.get(db, job_id=job_id)
        return request.app.state.job_bodies.render(job), job.version


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=responses(404, 409))
def cancel_job(job_id: JobIdDep, db: SessionDep, redis: RedisDep, settings: SettingsDep):
    """A queued job is cancelled at once; a running one once its supervisor has killed every process."""
    job, was_queued = lifecycle.request_cancel(db, job_id=job_id)
    if was_queued:
        try:
            queue.drop(redis, prefix=settings.queue_prefix, job_id=job.id, priority=job.priority)
        except RedisError:
            log.warning("could not drop cancelled job %s from Redis; the worker will skip it", job.id)
    return JobPublic.of(job)


STACKS_WAIT_S = 15.0


@router.post("/{job_id}/stacks", response_model=AttemptsPublic, responses=responses(404, 409, 504))
def take_stacks(job_id: JobIdDep, db: SessionDep):
    """Every rank's stack of a running job, taken by its workers without stopping it (py-spy dump).

    Answers the attempt's nodes with their new `stacks` once node 0's worker has stored them (it reads the
    request when it next renews its lease); 504 if it has not within 15 s (they stay on the attempt, shown by
    GET .../attempts, once taken).
    """
    asked = records.request_stacks(db, job_id=job_id)
    job = service.get(db, job_id=job_id)
    if asked is None:
        raise InvalidTransition(f"job {job_id} is {job.status}: only a running job's ranks have stacks", field="status")
    asked = job.stacks_requested_at  # as stored (the database's precision)
    deadline = time.monotonic() + STACKS_WAIT_S
    while time.monotonic() < deadline:
        db.expire_all()
        nodes = [a for a in service.attempts_of(db, job_id=job_id) if a.number == job.attempt]
        fresh = [a for a in nodes if (a.stacks or {}).get("requested_at")
                 and datetime.fromisoformat(a.stacks["requested_at"]) >= asked]
        if any(a.node_rank == 0 for a in fresh):
            return AttemptsPublic(items=[AttemptPublic.model_validate(a) for a in fresh], count=len(fresh))
        db.rollback()
        time.sleep(0.2)
    raise GatewayTimeout(f"the worker of job {job_id} did not send its stacks within {STACKS_WAIT_S:g}s")


@router.get("/{job_id}/attempts", response_model=AttemptsPublic, responses=responses(404))
def list_attempts(job_id: str, db: SessionDep, principal: PrincipalDep):
    """Every attempt of the job, oldest first: where it ran, how it ended, where it resumed from."""
    with db:  # the owner check and the read in one session, closed in this thread (see read_job)
        visible_job(db, job_id=job_id, principal=principal)
        attempts = service.attempts_of(db, job_id=job_id)
        return AttemptsPublic(items=[AttemptPublic.model_validate(a) for a in attempts], count=len(attempts))
