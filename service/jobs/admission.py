"""Admitting jobs: every check of a submission, the rows committed, then the queue entries. The one path by which
a job is made, whether submitted, cloned or a sweep's trial.

Several submissions at once (the API's admitter, service/api/admitter.py) are admitted together: each check a
round trip for all of them (the rates, the quotas, the keys, the live workers), one INSERT a table, one commit,
one Redis round trip for their queue entries. Each still gets its own answer: one refused never harms another.
"""

import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from service.auth.limits import check_rights, check_submissions
from service.auth.models import User
from service.auth.tokens import Principal
from service.errors import Forbidden, IdempotencyConflict, InvalidRequest, NotFound, TrainjobsError
from service.jobs import queue, service
from service.jobs.models import Job
from service.packages import service as packages
from service.scheduling import service as scheduling
from service.settings import Settings
from service.storage import Store, artifact_key, open_store
from service.storage.store import manifest_key
from service.workers import service as worker_rows
from trainjobs import paths
from trainjobs.spec import JobSpec, direct_reference

log = logging.getLogger(__name__)

Admitted = tuple[Job, bool]  # (job, created): created False when an earlier request with its key made it


@dataclass(frozen=True)
class Submission:
    spec: JobSpec
    principal: Principal
    idempotency_key: str | None = None
    cloned_from: str | None = None
    trial: service.Trial | None = None
    wait: bool = False  # taken though no live worker could run it now (allow_unschedulable): it waits for one


def admit(spec: JobSpec, *, db: Session, redis: Redis, settings: Settings, principal: Principal,
          idempotency_key: str | None, cloned_from: str | None = None, trial: service.Trial | None = None,
          needs: MutableMapping[str, scheduling.Req] | None = None, wait: bool = False) -> Admitted:
    """(job, created): created False when an earlier request with the same Idempotency-Key made it (then
    nothing is enqueued: were that job lost from Redis, the reconciler enqueues it)."""
    outcome = admit_many([Submission(spec, principal, idempotency_key, cloned_from, trial, wait)], db=db, redis=redis,
                         settings=settings, needs=needs)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def admit_many(asked: Sequence[Submission], *, db: Session, redis: Redis, settings: Settings,
               needs: MutableMapping[str, scheduling.Req] | None = None) -> list[Admitted | Exception]:
    """admit of each submission, in order, each answer its own: (job, created) or the error refusing it.

    `needs`: the process's kept needs of jobs (scheduling.snapshot's cache, app.state.job_needs): each new job's
    is put there, from the spec in hand, so this process's sweeper does not read and parse it again."""
    keys: set[tuple[str, str]] = set()
    later = []  # a key's second submission here (a client's retry): admitted after the first, as it would be
    for i, s in enumerate(asked):
        key = (s.principal.user, s.idempotency_key)
        if s.idempotency_key and key in keys:
            later.append(i)
        keys.add(key)
    if later:
        now = sorted(set(range(len(asked))) - set(later))
        answers = dict(zip(now, admit_many([asked[i] for i in now], db=db, redis=redis, settings=settings,
                                           needs=needs), strict=True))
        answers |= zip(later, admit_many([asked[i] for i in later], db=db, redis=redis, settings=settings,
                                         needs=needs), strict=True)
        return [answers[i] for i in range(len(asked))]

    outcome: list[Admitted | Exception | None] = [None] * len(asked)
    earlier = service.find_by_keys(db, {(s.principal.user, s.idempotency_key) for s in asked if s.idempotency_key})
    for i, s in enumerate(asked):
        job = earlier.get((s.principal.user, s.idempotency_key))
        if job is not None:
            outcome[i] = (job, False) if job.spec_hash == service.hash_spec(s.spec) else IdempotencyConflict(job.id)
    todo = [i for i in range(len(asked)) if outcome[i] is None]
    for i, refused in zip(todo, check_submissions(db, redis, settings, [(asked[i].principal, asked[i].spec)
                                                                        for i in todo]), strict=True):
        outcome[i] = refused
    live_workers = None
    new: dict[int, Job] = {}
    for i, s in enumerate(asked):
        if outcome[i] is not None:
            continue
        try:
            check_own(db, s, settings=settings)
            # A sweep's trials wait: the sweep was taken, and a pool restarting must not fail it.
            checked = not s.wait and s.trial is None
            if live_workers is None and (checked or worker_rows.needs_pip(s.spec)
                                         or worker_rows.plans_against_workers(s.spec)):
                live_workers = worker_rows.live(db, lost_after_s=settings.lease_s)
            worker_rows.check_pip(s.spec, live_workers=live_workers or [])
            if checked:
                worker_rows.check_schedulable(s.spec, live_workers=live_workers or [])
            memory = worker_rows.memory_of(live_workers) if worker_rows.plans_against_workers(s.spec) else []
            new[i] = service.new_job(s.spec, owner=s.principal.user, workers=memory, idempotency_key=s.idempotency_key,
                                     cloned_from=s.cloned_from, trial=s.trial)
        except TrainjobsError as exc:
            outcome[i] = exc
        except SQLAlchemyError:
            raise  # the database's: the batch's
        except Exception as exc:  # noqa: BLE001 - a bug one spec trips: that submission's 500, not its batch's
            log.exception("admitting a submission of %s failed", s.principal.user)
            outcome[i] = exc
    for i, stored in zip(new, service.store(db, list(new.values())), strict=True):
        outcome[i] = stored
    created = [o[0] for o in outcome if isinstance(o, tuple) and o[1]]
    if needs is not None:
        for job in created:
            needs[job.id] = scheduling.req_of(job.spec, job.plan)
    try:
        queue.enqueue_many(redis, prefix=settings.queue_prefix, jobs=[(j.id, j.priority, j.spec.timeout_s)
                                                                      for j in created])
    except RedisError:
        # Accepted all the same: the sweeper's reconcile pass enqueues them once Redis is back.
        log.exception("enqueue of jobs %s failed; the reconciler will retry", [j.id for j in created])
    return outcome


def check_own(db: Session, s: Submission, *, settings: Settings) -> None:
    """What only this submission's own spec asks: its package, its data file, the job it starts from."""
    spec = s.spec
    if spec.entrypoint is not None and spec.entrypoint.package is not None:  # the owner's own, or a 404
        packages.get(db, owner=s.principal.user, digest=spec.entrypoint.package, field="entrypoint.package")
    check_requirements(spec, settings=settings)
    check_gang(db, spec, principal=s.principal, settings=settings)
    service.check_inputs(spec, data_dir=settings.data_dir, hidden=settings.service_paths)
    if spec.init_from is not None:
        check_init_from(db, spec, principal=s.principal, settings=settings)


def check(spec: JobSpec, *, db: Session, settings: Settings, principal: Principal, wait: bool = False) -> JobSpec:
    """What submitting `spec` would check, and no job made: a dry submit (POST /v1/jobs:validate), so that a spec the
    service refuses costs no upload. Not looked at: its package (uploaded once the spec passes), the submission
    rate and the quota (a submission's). Returns the spec as a job would run it ("auto" resolved)."""
    check_rights(principal, spec)
    check_requirements(spec, settings=settings)
    check_gang(db, spec, principal=principal, settings=settings)
    service.check_inputs(spec, data_dir=settings.data_dir, hidden=settings.service_paths)
    if spec.init_from is not None:
        check_init_from(db, spec, principal=principal, settings=settings)
    live_workers = worker_rows.live(db, lost_after_s=settings.lease_s)
    worker_rows.check_pip(spec, live_workers=live_workers)
    if not wait:
        worker_rows.check_schedulable(spec, live_workers=live_workers)
    memory = worker_rows.memory_of(live_workers) if worker_rows.plans_against_workers(spec) else []
    return service.new_job(spec, owner=principal.user, workers=memory).spec


def check_gang(db: Session, spec: JobSpec, *, principal: Principal, settings: Settings) -> None:
    """A multi-node gang is a right (issue 41): its ranks share their hosts' network, loopback services included,
    so an admin grants it per user (users.multinode), unless the operator gave it to all (multinode_for_all).
    Read from the user's row, not the cached principal: a sweep's trials and a withdrawn right see it now."""
    if spec.resources.nnodes <= 1 or principal.is_admin or settings.multinode_for_all:
        return
    if db.scalar(select(User.multinode).where(User.name == principal.user)):
        return
    raise Forbidden(f"user {principal.user!r} may not run a multi-node job (resources.nnodes "
                    f"{spec.resources.nnodes}): a gang's ranks share their hosts' network, so it is a right an admin "
                    f"grants (trainjobs user set {principal.user} --multinode, or PATCH /v1/users/{principal.user} "
                    '{"multinode": true}); an operator may give it to everyone (TRAINJOBS_MULTINODE_FOR_ALL=1)',
                    field="resources.nnodes")


def check_init_from(db, spec: JobSpec, *, principal, settings: Settings) -> None:
    """The job to start from is the caller's (or any, for an admin: else 404) and has the weights asked for: in the
    store where one is set (issue 31: the source may have run on any machine; a checkpoint counts once its
    manifest is there), else in the storage dir. A store out of reach is a 503 (StoreUnavailable)."""
    source = db.get(Job, spec.init_from.job)
    if source is None or not (principal.is_admin or source.owner == principal.user):
        raise NotFound(f"init_from.job {spec.init_from.job!r} not found", field="init_from.job")
    store = open_store(settings)
    found = (stored_weights(store, source.id, spec.init_from.checkpoint) if store is not None
             else paths.init_source(settings.resolved_storage_dir, source.id, spec.init_from.checkpoint) is not None)
    if not found:
        what = "final model (artifacts/model.pt)" if spec.init_from.checkpoint == "final" else "complete checkpoint"
        raise InvalidRequest(f"init_from.job {source.id} ({source.status}) has no {what}", field="init_from.job")


def stored_weights(store: Store, job_id: str, checkpoint: str) -> bool:
    """Whether the store holds the job's final model.pt, or ("latest") a checkpoint with its manifest."""
    if checkpoint == "final":
        return store.head(artifact_key(job_id, paths.MODEL_FILE)) is not None
    return any(o.key.endswith(".json") for o in store.list(manifest_key(job_id)))


def check_requirements(spec: JobSpec, *, settings: Settings) -> None:
    """A requirement that names where pip fetches it (`name @ https://...`) only where the operator allows it
    (TRAINJOBS_ALLOW_DIRECT_URLS): else a job would choose what its build reaches. A requirements file in a
    package is checked by the worker, which reads it."""
    requirements = spec.entrypoint.requirements if spec.entrypoint is not None else None
    if settings.allow_direct_urls or not isinstance(requirements, list):
        return
    for i, line in enumerate(requirements):
        if direct_reference(line):
            raise InvalidRequest(f"entrypoint.requirements[{i}] {line!r} is a direct URL reference: this service "
                                 "installs requirements from its package index only (an operator may allow them "
                                 "with TRAINJOBS_ALLOW_DIRECT_URLS)", field=f"entrypoint.requirements[{i}]")
