"""The worker protocol's shipping calls (issue 42, docs/architecture.md "The worker protocol"): what an attempt's
node sends of its run (output, metric points, what its watch found, progress) and what it starts from.

`ship` applies one batch in one transaction: fenced (lifecycle.still_held: a batch of an attempt that lost its
job writes nothing, and its answer says so), then made idempotent by the batch's sequence number
(service/runners/streams.py), then written by the service functions the database worker used (metric points by
one binary COPY on PostgreSQL). A batch sent again (a retry after a lost answer, an API restart) is acknowledged
and applied once. Every list and string of a body is bounded (DESIGN.md rule 5): the worker cuts what it ships to
these bounds (worker/attempt/ship.py), and a body past them is a 422 naming the field.
"""

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service.jobs import lifecycle, records
from service.jobs.service import record_event
from service.logs import service as logs
from service.metrics import service as metrics
from service.runners import protocol, streams
from service.runners.attempt_calls import AttemptRef
from service.runners.points import Name, Point, Points, Step, Value, store_points
from service.runners.protocol import Context
from trainjobs.runenv import STEP_MAX

LOG_TEXT_MAX = 3 * 2**20  # characters of output a batch carries (the worker sends at most 1 MiB of its head + tail)
SAMPLES_MAX = 10_000  # usage samples a batch carries
WARNINGS_MAX = 256
STACK_RANKS_MAX, STACK_TEXT_MAX = 1024, 65536  # ranks of one node; characters of one rank's stack (worker/stacks.py)
NOTE_MAX, EVENT_DETAIL_MAX = 4000, 2000

Seq = Annotated[int, Field(ge=1, le=2**31 - 1)]


class LogPart(BaseModel):
    """The next chunk of the node's log: its byte offset in the whole log and its seq (log_chunks')."""

    start: int = Field(ge=0, le=2**62)
    seq: Seq
    text: str = Field(max_length=LOG_TEXT_MAX)


class ShipWarning(BaseModel):
    kind: Literal["straggler", "idle"]
    rank: int | None = Field(None, ge=0, le=2**20)
    attempt: int = Field(ge=1, le=2**31 - 1)
    message: str = Field(max_length=NOTE_MAX)


class RankStack(BaseModel):
    rank: int = Field(ge=0, le=2**20)
    pid: int = Field(ge=0, le=2**31)
    where: str = Field(max_length=NOTE_MAX)
    text: str = Field(max_length=STACK_TEXT_MAX)


class Stacks(BaseModel):
    """Every rank's stack (worker/stacks.py dump): a hang's (with its message) or asked for (with the request's
    time)."""

    reason: Literal["hang", "requested"]
    taken_at: datetime
    ranks: list[RankStack] = Field(max_length=STACK_RANKS_MAX)
    message: str | None = Field(None, max_length=NOTE_MAX)
    requested_at: datetime | None = None


class Progress(BaseModel):
    """The job's progress as the node's ranks report it (service/jobs/schemas.py reads it back)."""

    step: Step
    total_steps: int | None = Field(None, ge=0, lt=STEP_MAX)
    eta_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    performance: dict[Name, Value] | None = Field(None, max_length=32)


class ShipBody(AttemptRef):
    """One batch of one attempt's node. `seq`: the worker's number for it, one more per new batch (a batch sent
    again keeps its number and its content). Every part may be left out."""

    seq: Seq
    log: LogPart | None = None
    points: Points = Field([], description="rows [[step, name, value, unix time], ...] or packed columns "
                           "(service/runners/points.py)")
    warnings: list[ShipWarning] = Field([], max_length=WARNINGS_MAX)
    stacks: Stacks | None = None
    samples: list[Point] = Field([], max_length=SAMPLES_MAX)
    caps_note: str | None = Field(None, max_length=NOTE_MAX, description="what the metric caps kept out, so far")
    resumed_from_step: Step | None = None
    progress: Progress | None = None
    gang: bool = Field(False, description="a node of a gang: its progress moves the job's only when it is ahead")
    final: bool = Field(False, description="the drain's: the ranks are gone")


class Acknowledged(BaseModel):
    applied: bool = Field(description="false: nothing written (a batch applied before, or `lost`)")
    lost: bool = Field(description="the attempt no longer holds its job: stop, send nothing more")


class EventBody(AttemptRef):
    seq: Seq
    kind: Literal["store_waiting", "store_back"]
    detail: str = Field("", max_length=EVENT_DETAIL_MAX)


class Opened(BaseModel):
    """What an attempt's shippers start from (worker/supervisor.py): the node's log so far, what earlier attempts
    used of the job's metric caps, and this attempt's streams' last applied sequence numbers."""

    log_bytes: int
    log_seq: int
    metric_names: list[str]
    metric_points: int
    seq: int
    event_seq: int


@protocol.call("open", body=AttemptRef, answer=Opened)
def open_attempt(db: Session, ctx: Context, body: AttemptRef) -> Opened:
    """What an attempt's shippers start from: the node's stored log (bytes, next chunk seq), the metric names and
    points earlier attempts stored (the job's caps count them), the last sequence applied per stream."""
    ref = {"job_id": body.job_id, "attempt": body.attempt, "node_rank": body.node_rank}
    protocol.own_attempt(db, ctx.caller, **ref)
    log_bytes, log_seq = logs.log_size(db, job_id=body.job_id, node_rank=body.node_rank)
    names, points = metrics.stored(db, job_id=body.job_id, node_rank=body.node_rank)
    return Opened(log_bytes=log_bytes, log_seq=log_seq, metric_names=sorted(names), metric_points=points,
                  seq=streams.last(db, **ref, stream=streams.SHIP), event_seq=streams.last(db, **ref,
                                                                                       stream=streams.EVENTS))


@protocol.call("ship", body=ShipBody, answer=Acknowledged)
def ship(db: Session, ctx: Context, body: ShipBody) -> Acknowledged:
    """One batch of an attempt's node (its output, metric points, warnings, stacks, usage samples, the metric caps'
    note, resume step and progress), in one transaction: nothing once the attempt lost its job (`lost`), nothing
    for a batch applied before (`applied`: false)."""
    return _fenced(db, ctx, body, streams.SHIP, lambda held: apply_ship(db, body, held))


@protocol.call("event", body=EventBody, answer=Acknowledged)
def event(db: Session, ctx: Context, body: EventBody) -> Acknowledged:
    """A job event of an attempt's node (its checkpoints waiting for the object store, then stored again): stored
    once however often it is sent, nothing once the attempt lost its job."""
    return _fenced(db, ctx, body, streams.EVENTS, lambda held: apply_event(db, body))


def _fenced(db: Session, ctx: Context, body: ShipBody | EventBody, stream: str, write) -> Acknowledged:
    """`write(held)` in one transaction: for the caller's own attempt only (403), while it holds its job, and once
    per sequence number of the stream."""
    ref = {"job_id": body.job_id, "attempt": body.attempt, "node_rank": body.node_rank}
    protocol.own_attempt(db, ctx.caller, **ref)
    held = lifecycle.still_held(db, **ref)
    if held is None:
        db.rollback()
        return Acknowledged(applied=False, lost=True)
    if not streams.advance(db, **ref, stream=stream, seq=body.seq):
        db.rollback()
        return Acknowledged(applied=False, lost=False)
    write(held)
    db.commit()
    return Acknowledged(applied=True, lost=False)


def apply_event(db: Session, body: EventBody) -> None:
    record_event(db, job_id=body.job_id, kind=body.kind, detail=body.detail)


def apply_ship(db: Session, body: ShipBody, held: lifecycle.Held) -> None:
    """The batch's parts, in today's order: the job's row (warnings, progress) last, so its lock is held only for
    the end of the transaction."""
    job_id, attempt, node_rank = body.job_id, body.attempt, body.node_rank
    if body.log is not None:
        logs.append(db, job_id=job_id, attempt=attempt, node_rank=node_rank, start=body.log.start, seq=body.log.seq,
                    text=body.log.text)
    if body.points:
        store_points(db, job_id=job_id, attempt=attempt, node_rank=node_rank, points=body.points)
    apply_rare(db, body)
    if body.progress is not None and moves_progress(body, held):
        records.record_progress(db, job_id=job_id, attempt=attempt, progress=body.progress.model_dump(
            exclude_unset=True))


def apply_rare(db: Session, body: ShipBody) -> None:
    """The parts a batch seldom carries: warnings, stacks, usage samples, the metric caps' note, the resume step."""
    job_id, attempt, node_rank = body.job_id, body.attempt, body.node_rank
    for warning in body.warnings:
        records.add_warning(db, job_id=job_id, warning=warning.model_dump())
    if body.stacks is not None:
        records.record_stacks(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                              stacks=body.stacks.model_dump(mode="json", exclude_none=True))
    if body.samples:
        metrics.replace_samples(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                rows=metrics.shipped_rows(body.samples))
    if body.caps_note is not None:
        records.set_warning(db, job_id=job_id, warning={"kind": "metrics_capped", "message": body.caps_note,
                                                        "attempt": attempt, "node_rank": node_rank})
    if body.resumed_from_step is not None:
        records.record_resume(db, job_id=job_id, attempt=attempt, node_rank=node_rank, step=body.resumed_from_step)


def moves_progress(body: ShipBody, held: lifecycle.Held) -> bool:
    """Whether the batch's progress is the job's."""
    # Every node's local rank 0 reports its own series; node 0's is the job's, and its progress once it has
    # reported. Another node's moves progress only when it is ahead: a user's script that reports on global
    # rank 0 alone (RANK == 0) reports from whichever node c10d gave that rank.
    if body.progress is None:
        return False
    step = body.progress.step
    return not body.gang or step > held.progress_step or (body.node_rank == 0 and step > 0)
