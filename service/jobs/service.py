"""Job operations on the database: create, read, list and compare-and-set transitions."""

import hashlib
import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Row, select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db import utcnow
from service.errors import IdempotencyConflict, InvalidRequest, JobNotFound
from service.jobs import notify as notifications
from service.jobs.models import Attempt, Job, JobEvent, JobTag
from service.lists import newest_first, page_of
from trainjobs import plan as memory_plan
from trainjobs.paths import is_job_id, missing_data_path, new_job_id, resolve_data_path
from trainjobs.plan import WorkerMemory
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus

DEFAULT_OWNER = "admin"  # the owner of jobs made without a principal (tests, TRAINJOBS_AUTH=off)


def record_event(db: Session, *, job_id: str, kind: str, detail: str | None = None, notify: str | None = None) -> None:
    """Append to the job's audit trail; an event webhooks name (or `notify`'s) goes to their outbox with it."""
    db.add(JobEvent(job_id=job_id, kind=kind, detail=detail, time=utcnow()))
    event = notify or notifications.EVENT_OF_KIND.get(kind)
    if event is not None:
        notifications.notify(db, job_id=job_id, event=event)


def check_inputs(spec: JobSpec, *, data_dir: Path, hidden: Iterable[Path] = ()) -> None:
    """What the spec alone cannot know: that its files exist where the workers will look (and are no service
    file, `hidden`: refused in the same words as a missing one)."""
    if spec.data is not None and spec.data.type == "text":
        path = resolve_data_path(spec.data.path, data_dir, hidden=hidden)
        if not path.is_file():
            raise InvalidRequest(missing_data_path(spec.data.path), field="data.path")


def hash_spec(spec: JobSpec) -> str:
    """Of the spec as submitted (defaults filled in, "auto" not yet resolved), so a resubmission matches."""
    return hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Trial:
    """What makes a job a sweep's trial: the sweep, its number there and its parameters."""

    sweep_id: str
    index: int
    params: dict[str, Any]


def new_job(spec: JobSpec, *, owner: str = DEFAULT_OWNER, workers: Sequence[WorkerMemory] = (),
            idempotency_key: str | None = None, cloned_from: str | None = None, trial: Trial | None = None) -> Job:
    """A queued job, not yet stored (add stores it).

    A job with a model gets a memory plan (against the live workers' memory); strategy "auto" is stored as
    the plan's choice, so a worker never sees "auto", or refused (422) when nothing fits.
    """
    spec_hash = hash_spec(spec)
    spec, plan = memory_plan.resolve(spec, workers)
    now = utcnow()
    return Job(
        id=new_job_id(),
        owner=owner,
        name=spec.name,
        spec=spec,
        spec_hash=spec_hash,
        idempotency_key=idempotency_key,
        status=JobStatus.QUEUED,
        priority=spec.priority,
        attempt=0,
        max_retries=spec.max_retries,
        created_at=now,
        queued_at=now,
        plan=plan.model_dump(mode="json") if plan else None,
        version=1,  # the server default's, set here so the INSERT needs no RETURNING
        cloned_from=cloned_from,
        sweep_id=trial.sweep_id if trial else None,
        sweep_trial=trial.index if trial else None,
        sweep_params=trial.params if trial else None,
    )


def add(db: Session, jobs: Sequence[Job]) -> None:
    """Insert new jobs, their tags and their first event: one INSERT a table however many jobs (the caller
    commits, then enqueues)."""
    db.add_all(jobs)
    db.flush()
    db.add_all(JobTag(job_id=job.id, tag=tag) for job in jobs for tag in dict.fromkeys(job.spec.tags))
    for job in jobs:
        if job.sweep_id is not None:
            detail = f"trial {job.sweep_trial} of sweep {job.sweep_id}"
        else:
            detail = f"cloned from {job.cloned_from}" if job.cloned_from else "submitted"
        record_event(db, job_id=job.id, kind=JobStatus.QUEUED, detail=detail)


def create(db: Session, *, spec: JobSpec, owner: str = DEFAULT_OWNER, workers: Sequence[WorkerMemory] = (),
           idempotency_key: str | None = None, cloned_from: str | None = None, trial: Trial | None = None) -> Job:
    """Insert a queued job (new_job, then add; the caller commits, then enqueues)."""
    job = new_job(spec, owner=owner, workers=workers, idempotency_key=idempotency_key, cloned_from=cloned_from,
                  trial=trial)
    add(db, [job])
    return job


def find_by_keys(db: Session, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], Job]:
    """(owner, idempotency key) → the job an earlier submission with that key made, for those that exist (one
    query)."""
    if not keys:
        return {}
    found = db.scalars(select(Job).where(tuple_(Job.owner, Job.idempotency_key).in_(list(keys))))
    return {(job.owner, job.idempotency_key): job for job in found}


def store(db: Session, jobs: Sequence[Job]) -> list[tuple[Job, bool] | Exception]:
    """Insert and commit new jobs (all in one transaction), each as (job, True), or (the other job, False) where
    a concurrent request with the same key committed first.

    The unique (owner, idempotency_key) decides that race: the loser's INSERT fails. Then the transaction rolls
    back and the jobs are stored one at a time: each loser answers with the winner's job (or its 409, when the
    winner carried another spec), so concurrent duplicates make exactly one job.
    """
    try:
        add(db, jobs)
        db.commit()
        return [(job, True) for job in jobs]
    except IntegrityError as exc:
        db.rollback()
        if len(jobs) == 1:
            return [_winner(db, jobs[0], exc)]
    stored: list[tuple[Job, bool] | Exception] = []
    for job in jobs:
        try:
            add(db, [job])
            db.commit()
            stored.append((job, True))
        except IntegrityError as exc:
            db.rollback()
            stored.append(_winner(db, job, exc))
    return stored


def _winner(db: Session, job: Job, lost: IntegrityError) -> tuple[Job, bool] | Exception:
    """The job that made `job`'s INSERT fail on its idempotency key, or what else failed it."""
    existing = db.scalar(select(Job).where(Job.owner == job.owner, Job.idempotency_key == job.idempotency_key)
                         ) if job.idempotency_key else None
    if existing is None:
        return lost
    if existing.spec_hash != job.spec_hash:
        return IdempotencyConflict(existing.id)
    return existing, False


def get(db: Session, *, job_id: str) -> Job:
    job = db.get(Job, job_id) if is_job_id(job_id) else None
    if job is None:
        raise JobNotFound(job_id)
    return job


def owned_by(db: Session, *, job_ids: Collection[str], owner: str) -> set[str]:
    """The ids in job_ids of jobs that owner owns (one query)."""
    if not job_ids:
        return set()
    return set(db.scalars(select(Job.id).where(Job.id.in_(list(job_ids)), Job.owner == owner)))


def dispatch_view(db: Session, *, job_ids: Collection[str]) -> dict[str, Row]:
    """What a worker's dequeue looks at, per job: id, status, attempt, spec and plan (one query)."""
    if not job_ids:
        return {}
    return {r.id: r for r in db.execute(select(Job.id, Job.status, Job.attempt, Job.spec, Job.plan)
                                        .where(Job.id.in_(list(job_ids))))}


def list_page(
    db: Session, *, status: JobStatus | None = None, limit: int = 50, cursor: str | None = None,
    owner: str | None = None, name: str | None = None, tag: str | None = None, sweep: str | None = None,
) -> tuple[list[Row], str | None]:
    """(id, version) of a page of jobs, newest first; the cursor is the id of the last job of the previous page.

    Ids and versions only (an index range, no JSON parsed): the caller loads the jobs it has not rendered.
    """
    query = newest_first(select(Job.id, Job.version), Job.id, cursor=cursor, limit=limit)
    if status is not None:
        query = query.where(Job.status == status)
    if owner is not None:
        query = query.where(Job.owner == owner)
    if name:
        query = query.where(Job.name.startswith(name, autoescape=True))
    if tag:
        query = query.where(Job.id.in_(select(JobTag.job_id).where(JobTag.tag == tag)))
    if sweep:
        query = query.where(Job.sweep_id == sweep)
    return page_of(db.execute(query).all(), limit=limit)


def get_many(db: Session, *, job_ids: Collection[str]) -> list[Job]:
    """The jobs of job_ids that exist (one query)."""
    return list(db.scalars(select(Job).where(Job.id.in_(list(job_ids))))) if job_ids else []


def attempts_of(db: Session, *, job_id: str) -> list[Attempt]:
    get(db, job_id=job_id)
    return list(db.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number, Attempt.node_rank)))
