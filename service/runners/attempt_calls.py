"""The worker protocol's calls on an attempt's life (issue 42): what a worker says of the attempts it runs.

claim → bind → (gang_join, gang_check, gang_release for a gang's nodes) → phase → running → leases (on their own
thread, all along) → outcome → free. Each is a compare-and-set of service/jobs/lifecycle.py (or a holds or records
write) behind `protocol.own_worker` / `protocol.own_attempt`, and answers a replay (the same call sent again after
its answer was lost) as it answered the first time, moving nothing again: the compare-and-sets refuse a second
move, and lifecycle's replay reads say whether the first one was this caller's.
"""

import dataclasses
import json
import logging
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import Forbidden, InvalidRequest
from service.jobs import lifecycle, queue, records, renewals
from service.jobs.models import Job
from service.runners import protocol
from service.runners.protocol import Context
from service.scheduling import quota
from service.workers import holds
from service.workers import service as workers
from trainjobs.spec import JobSpec
from trainjobs.states import AttemptStatus, ErrorType, JobStatus

log = logging.getLogger(__name__)
JOB_ID = Field(max_length=32)
WORKER_ID = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")  # a worker process's name (its row's id)


class AttemptRef(BaseModel):
    job_id: str = JOB_ID
    attempt: int = Field(ge=1, le=2**31 - 1)
    node_rank: int = Field(0, ge=0, le=4096)


# --- a worker takes a job ------------------------------------------------------------------------------------

class ClaimBody(BaseModel):
    job_id: str = JOB_ID
    worker_id: str = WORKER_ID


class ClaimPublic(BaseModel):
    claimed: bool
    why: str | None = Field(None, description="why not: the job moved on, or it would go over a quota (it is "
                            "back on its queue)")
    attempt: int | None = None
    spec: JobSpec | None = None


@protocol.call("claim", body=ClaimBody, answer=ClaimPublic)
def claim(db: Session, ctx: Context, body: ClaimBody) -> ClaimPublic:
    """queued → starting, opening the attempt (node 0) with its lease: its number and spec. A claim that would put
    the job's team or owner over its quota leaves it queued and back on its queue. A gang's claim kicks a scheduling
    pass, which hands its other nodes' tasks to the workers it assigned them. The same worker claiming again before
    it bound the attempt (its answer lost) gets the same."""
    protocol.own_worker(ctx.caller, body.worker_id)
    if (again := lifecycle.claimed_by(db, job_id=body.job_id, worker=body.worker_id)) is not None:
        return ClaimPublic(claimed=True, attempt=again[0], spec=again[1])
    if (why := quota.over_quota(db, job_id=body.job_id)) is not None:
        db.rollback()
        _put_back(db, ctx, job_id=body.job_id)
        return ClaimPublic(claimed=False, why=f"{why}; back on its queue")
    claimed = lifecycle.claim(db, job_id=body.job_id, worker=body.worker_id, lease_s=ctx.settings.lease_s)
    db.commit()
    if claimed is None:
        status = db.scalar(select(Job.status).where(Job.id == body.job_id))
        return ClaimPublic(claimed=False, why=f"job {body.job_id} is {status or 'not there'}")
    attempt, spec = claimed
    if spec.resources.nnodes > 1:
        _enqueue_nodes(ctx, job_id=body.job_id, attempt=attempt, spec=spec)
    return ClaimPublic(claimed=True, attempt=attempt, spec=spec)


def _put_back(db: Session, ctx: Context, *, job_id: str) -> None:
    """A queued job's entry again, for the next plan (the sweeper's reconciler puts it back too, later)."""
    try:
        queue.put_back(db, ctx.redis, prefix=ctx.settings.queue_prefix, job_id=job_id)
    except RedisError:
        log.warning("could not put job %s back on its queue; the reconciler will", job_id)


def _enqueue_nodes(ctx: Context, *, job_id: str, attempt: int, spec: JobSpec) -> None:
    try:
        queue.enqueue_nodes(ctx.redis, prefix=ctx.settings.queue_prefix, job_id=job_id, attempt=attempt,
                            nnodes=spec.resources.nnodes, timeout_s=spec.timeout_s)
    except RedisError:  # the pass's next tick hands them (or, never joined, undoes the gang)
        log.exception("could not kick the pass that hands the node tasks of job %s", job_id)


class BindBody(AttemptRef):
    worker_id: str = WORKER_ID
    placement: dict[str, Any] | None = Field(None, max_length=64, description="where the node runs (its share: "
                                             "devices, GPU UUIDs, cores), stored with the attempt and the job")


class BindPublic(BaseModel):
    devices: list[int] = Field(description="the devices of the worker the node holds, in order ([]: the whole "
                               "worker)")


@protocol.call("bind", body=BindBody, answer=BindPublic)
def bind(db: Session, ctx: Context, body: BindBody) -> BindPublic:
    """The devices the worker's dispatcher took for this node, tied to its attempt (then, sent again with its
    placement, where it runs)."""
    protocol.own_worker(ctx.caller, body.worker_id)
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    devices = holds.bind(db, worker_id=body.worker_id, job_id=body.job_id, node_rank=body.node_rank,
                         attempt=body.attempt, placement=body.placement)
    db.commit()
    return BindPublic(devices=devices)


class FreeBody(BaseModel):
    job_id: str = JOB_ID
    worker_id: str = WORKER_ID
    node_rank: int | None = Field(None, ge=0, le=4096, description="null: every node of the job on this worker")


@protocol.call("free", body=FreeBody)
def free(db: Session, ctx: Context, body: FreeBody) -> None:
    """The worker is done with this node of the job: its devices go back, and it takes another job."""
    protocol.own_worker(ctx.caller, body.worker_id)
    workers.release(db, worker_id=body.worker_id, job_id=body.job_id, node_rank=body.node_rank)
    db.commit()


# --- while it runs -------------------------------------------------------------------------------------------

class PhaseBody(AttemptRef):
    phase: str = Field(max_length=500)


@protocol.call("phase", body=PhaseBody)
def phase(db: Session, ctx: Context, body: PhaseBody) -> None:
    """What a starting attempt is doing before its ranks run (installing requirements, launching): the job's
    pending_reason while it starts. Written only while the attempt holds the job and it starts."""
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    records.record_phase(db, job_id=body.job_id, attempt=body.attempt, phase=body.phase)
    db.commit()


class RunningBody(AttemptRef):
    detail: str = Field(max_length=500, description="what the job's event says (the torchrun pid)")


class RunningPublic(BaseModel):
    running: bool = Field(description="false: the attempt no longer holds the job (stop its ranks)")


@protocol.call("running", body=RunningBody, answer=RunningPublic)
def running(db: Session, ctx: Context, body: RunningBody) -> RunningPublic:
    """starting → running, once the attempt's ranks are launched; true again for a replay."""
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    moved = lifecycle.start_running(db, job_id=body.job_id, attempt=body.attempt, detail=body.detail)
    db.commit()
    return RunningPublic(running=moved or lifecycle.runs(db, job_id=body.job_id, attempt=body.attempt))


class LeasesBody(BaseModel):
    attempts: list[AttemptRef] = Field(max_length=4096)


class HeldPublic(BaseModel):
    """What a node that still holds its job learns on each renewal (service/jobs/lifecycle.py Held)."""

    cancel_requested: bool
    progress_step: int
    stacks_requested_at: datetime | None = None
    preempt_detail: str | None = None
    stopped_early: bool = False


class LeasePublic(AttemptRef):
    held: HeldPublic | None = Field(description="null: the attempt lost its job (a cancel of a forming gang, the "
                                    "sweeper after its lease ran out): stop its ranks and write nothing more")


class LeasesPublic(BaseModel):
    leases: list[LeasePublic]


@protocol.call("leases", body=LeasesBody, answer=LeasesPublic)
def leases(db: Session, ctx: Context, body: LeasesBody) -> LeasesPublic:
    """Renew the leases of the attempts this machine runs (by the database's clock) and say what each job asks of
    them: a cancel, a preemption, its stacks, a sweep's early stop. An attempt of another machine's is a 403."""
    refs = [(a.job_id, a.attempt, a.node_rank) for a in body.attempts]
    owners = lifecycle.attempt_workers(db, refs=refs)
    for (job_id, attempt, _), owner in owners.items():
        if not ctx.caller.owns(owner):
            raise Forbidden(f"attempt {attempt} of job {job_id} is not runner {ctx.caller.name!r}'s",
                            field="attempts")
    mine = [key for key in refs if key in owners]
    helds = renewals.hold_many(db, mine, jobs=renewals.lock_jobs(db, {job for job, _, _ in mine}),
                              lease_s=ctx.settings.lease_s)  # one UPDATE for them all, one commit
    db.commit()
    out = [LeasePublic(**ref.model_dump(), held=public_held(helds.get(key))) for ref, key in zip(body.attempts, refs,
                                                                                            strict=True)]
    return LeasesPublic(leases=out)


def public_held(held: lifecycle.Held | None) -> HeldPublic | None:
    return None if held is None else HeldPublic(**dataclasses.asdict(held))


# --- an attempt ends -----------------------------------------------------------------------------------------

class OutcomeBody(AttemptRef):
    status: Literal["queued", "failed", "succeeded", "cancelled"] = Field(
        description="queued: handed back (a shutdown, a preemption), no retry spent; failed: the retry rule decides")
    exit_code: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    error: dict[str, Any] | None = Field(None, max_length=64)
    summary: dict[str, Any] | None = Field(None, max_length=4096)
    detail: str | None = Field(None, max_length=2000, description="a hand-back's reason, for the job's events")


class OutcomePublic(BaseModel):
    recorded: bool = Field(description="false: the job had moved on (a newer attempt, a cancel, the sweeper)")
    job_status: JobStatus | None = None


@protocol.call("outcome", body=OutcomeBody, answer=OutcomePublic)
def outcome(db: Session, ctx: Context, body: OutcomeBody) -> OutcomePublic:
    """How this node of the attempt ended, recorded once (fenced by the attempt): a hand-back requeues the job, a
    failure goes through the retry rule, a success or a cancel is the job's once its last node ends. A replay
    answers "recorded" again and moves nothing."""
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    moved = _record(db, body)
    db.commit()
    recorded = bool(moved) or _closed_as(lifecycle.node_end(db, job_id=body.job_id, attempt=body.attempt,
                                                            node_rank=body.node_rank), body)
    return OutcomePublic(recorded=recorded, job_status=db.scalar(select(Job.status).where(Job.id == body.job_id)))


def _record(db: Session, body: OutcomeBody) -> object:
    ref = {"job_id": body.job_id, "attempt": body.attempt, "node_rank": body.node_rank}
    if body.status == JobStatus.QUEUED:
        return lifecycle.hand_back(db, **ref, detail=body.detail or "handed back by its worker")
    if body.status == JobStatus.FAILED:
        # Cut off past its lease, the supervisor stopped its ranks itself: the attempt is lost, as the sweeper
        # would have said.
        return lifecycle.settle_failure(db, **ref, error=body.error or {}, attempt_status=_failed_as(body),
                                        exit_code=body.exit_code)
    # A success after retries keeps the earlier attempts' causes in `error`.
    return lifecycle.finish_node(db, **ref, status=JobStatus(body.status), summary=body.summary, error=body.error,
                                 exit_code=body.exit_code)


def _failed_as(body: OutcomeBody) -> AttemptStatus:
    return AttemptStatus.LOST if (body.error or {}).get("type") == ErrorType.WORKER_LOST else AttemptStatus.FAILED


def _closed_as(end: tuple[str, dict | None, int | None] | None, body: OutcomeBody) -> bool:
    """Whether the node was closed as this outcome closes it (by an earlier send of it), not by the sweeper, a
    peer's failure or a cancel."""
    if end is None:
        return False
    status, error, exit_code = end
    if body.status == JobStatus.QUEUED:
        return status == AttemptStatus.PREEMPTED and error is None
    if body.status == JobStatus.FAILED:  # a cancel asked meanwhile closes a failure as cancelled
        wanted = {_failed_as(body), AttemptStatus.CANCELLED}
        return status in wanted and _plain(error) == _plain(body.error or {}) and exit_code == body.exit_code
    return status == body.status and _plain(error) == _plain(body.error) and exit_code == body.exit_code


def _plain(value: Any) -> Any:
    """As the database's JSON gives it back (tuples as lists, keys as text)."""
    return json.loads(json.dumps(value))


# --- a gang forms --------------------------------------------------------------------------------------------

class JoinBody(AttemptRef):
    node_rank: int = Field(ge=1, le=4096)
    worker_id: str = WORKER_ID


class JoinPublic(BaseModel):
    joined: bool = Field(description="false: the gang formed, moved on, or another worker took the node")
    spec: JobSpec | None = None


@protocol.call("gang_join", body=JoinBody, answer=JoinPublic)
def gang_join(db: Session, ctx: Context, body: JoinBody) -> JoinPublic:
    """Take node `node_rank` of the gang forming for `attempt`, with its lease; the same worker joining again (its
    answer lost) gets the same."""
    protocol.own_worker(ctx.caller, body.worker_id)
    ref = {"job_id": body.job_id, "attempt": body.attempt, "node_rank": body.node_rank, "worker": body.worker_id}
    spec = lifecycle.joined_by(db, **ref)
    if spec is None:
        spec = lifecycle.join(db, **ref, lease_s=ctx.settings.lease_s)
        db.commit()
    return JoinPublic(joined=spec is not None, spec=spec)


class OfferBody(BaseModel):
    """What the worker offers a node (as it registers): a younger forming gang yields to an older one it fits."""

    device: Literal["cpu", "cuda"]
    slots: int = Field(ge=1, le=4096)
    memory_bytes: int | None = Field(None, ge=0)
    labels: dict[str, str] = Field(default_factory=dict, max_length=256)


@dataclasses.dataclass(frozen=True)
class _Offer:  # service/workers/fit.Offer
    id: str
    device: str
    slots: int
    memory_bytes: int | None
    labels: dict[str, str]


class GangCheckBody(AttemptRef):
    worker_id: str = WORKER_ID
    offer: OfferBody
    endpoint: str | None = Field(None, pattern=r"^\S{1,290}:\d{1,5}$", description="node 0: host:port it found "
                                 "free on its address, the rendezvous should the gang form now")


GangState = Literal["formed", "waiting", "lost", "cancelled", "timeout", "yielded"]


class GangCheckPublic(BaseModel):
    state: GangState
    endpoint: str | None = Field(None, description="formed: node 0's rendezvous, host:port")


@protocol.call("gang_check", body=GangCheckBody, answer=GangCheckPublic)
def gang_check(db: Session, ctx: Context, body: GangCheckBody) -> GangCheckPublic:
    """One look at a forming gang, renewing this node's lease: formed (with the endpoint), waiting, or why not
    (lost, cancelled, timeout, yielded to an older gang). Node 0 forms it once every node is in."""
    protocol.own_worker(ctx.caller, body.worker_id)
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    if body.node_rank == 0 and body.endpoint is None:
        raise InvalidRequest("node 0 proposes the gang's rendezvous: send endpoint (host:port free on its address)",
                             field="endpoint")
    offer = _Offer(body.worker_id, body.offer.device, body.offer.slots, body.offer.memory_bytes, body.offer.labels)
    endpoint, state = lifecycle.check_gang(
        db, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank, lease_s=ctx.settings.lease_s,
        gang_timeout_s=ctx.settings.gang_timeout_s, offer=offer, address=(body.endpoint or "").rpartition(":")[0],
        endpoint=body.endpoint)
    db.commit()
    return GangCheckPublic(state=state, endpoint=endpoint)


class GangReleaseBody(AttemptRef):
    why: str = Field(max_length=500)


class GangReleasePublic(BaseModel):
    released: bool = Field(description="false: the gang had moved on (formed, released, cancelled)")


@protocol.call("gang_release", body=GangReleaseBody, answer=GangReleasePublic)
def gang_release(db: Session, ctx: Context, body: GangReleaseBody) -> GangReleasePublic:
    """A gang still forming lets every node go (this node's worker is shutting down): the job is queued again at
    once, no retry spent."""
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    released = lifecycle.release_gang(db, job_id=body.job_id, attempt=body.attempt, why=body.why)
    db.commit()
    if not released:  # a replay: this node closed by this release
        end = lifecycle.node_end(db, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
        released = end is not None and end[0] == AttemptStatus.PREEMPTED and \
            (end[1] or {}).get("message") == f"stopped with its gang ({body.why})"
    return GangReleasePublic(released=released)
