"""The worker protocol's `tick` (issue 42, docs/architecture.md "The worker protocol"): one request per worker per
tick carrying its heartbeat, the leases of every attempt it runs and every batch they ship, written in one
transaction.

The worker's relay (worker/tick.py) gathers what its attempts' supervisors send within a tick and sends it as one
call; the answer is split back to each. Before, a worker with 8 running attempts sent a heartbeat, 8 lease renewals
(each its own transaction: a lock, an UPDATE, a commit) and up to 8 ships per tick, each paying the API's fixed
cost of a request (bench/README.md "The worker protocol").

In the transaction: the caller's ownership of every attempt named (one SELECT; another runner's is a 403 naming the
item), the heartbeat, the jobs' rows locked in id order (service/jobs/renewals.py), every lease renewed in one
UPDATE, every batch's fence read in one SELECT, then the batches written together, each as `ship` would write it
and idempotent by its sequence number: one statement advances every batch's stream (those it does not advance were
applied before), then one INSERT of their log chunks, one COPY of their points, one upsert of their block summaries
and one UPDATE of the progress that moved (a tick's statements, not its batches', were most of its database CPU:
bench/README.md). A batch the database refuses (bad data) is refused alone: when the batches written together are
refused, that savepoint is rolled back and each batch is written again under a savepoint of its own, so only the bad
one is answered `refused`; one attempt's bad batch never keeps another's from being stored. One commit.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from pydantic import BaseModel, Field
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from service.db import UNREACHABLE, is_refusal
from service.errors import Forbidden, TrainjobsError
from service.jobs import lifecycle, records, renewals
from service.logs import service as logs
from service.metrics import service as metrics
from service.runners import credentials, protocol, streams
from service.runners.attempt_calls import AttemptRef, LeasePublic, public_held
from service.runners.points import PointColumns
from service.runners.protocol import Caller, Context
from service.runners.ship_calls import (
    Acknowledged,
    EventBody,
    ShipBody,
    apply_event,
    apply_rare,
    apply_ship,
    moves_progress,
)
from service.workers import service as workers

WORKER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$"
LEASES_MAX = 4096  # attempt nodes one worker may run (its slots' bound)
BATCHES_MAX = 1024  # batches (ships, events) of one tick; the worker sends the rest in the next
REFUSED_MAX = 500  # characters of a refusal's reason
IMAGES_MAX = 1024  # images a worker reports having (worker/images.py CACHED_MAX)
Image = Annotated[str, Field(min_length=1, max_length=600)]  # a reference or a sha256 digest


class BeatBody(BaseModel):
    worker_id: str = Field(pattern=WORKER_ID)
    draining: bool = False
    pressure: str | None = Field(None, max_length=512)
    devices: list[dict[str, Any]] | None = Field(None, max_length=4096)
    images: list[Image] | None = Field(None, max_length=IMAGES_MAX, description="the images it has unpacked "
                                       "(references, sha256 digests), when they changed: the pass prefers it for them")


class BeatPublic(BaseModel):
    registered: bool = Field(description="false: the row is gone (pruned while cut off): register again")


class TickBody(BaseModel):
    """What one worker process sends in a tick: every part may be left out."""

    heartbeat: BeatBody | None = None
    leases: list[AttemptRef] = Field([], max_length=LEASES_MAX, description="the attempt nodes whose leases to renew")
    ships: list[ShipBody] = Field([], max_length=BATCHES_MAX, description="batches, as `ship` takes them")
    events: list[EventBody] = Field([], max_length=BATCHES_MAX, description="job events, as `event` takes them")


class Batched(Acknowledged):
    """A batch of a tick, answered as `ship` answers it, or refused alone."""

    refused: str | None = Field(None, description="the database would not take this batch (why): nothing of it was "
                                "written, and the same again would be refused again")


class TickPublic(BaseModel):
    """Each part answered in the order sent: a lease as `leases` answers it, a batch as `ship` (or `event`)."""

    heartbeat: BeatPublic | None = None
    leases: list[LeasePublic] = []
    ships: list[Batched] = []
    events: list[Batched] = []


def own_registered(db: Session, caller: Caller, worker_id: str, *, field: str = "worker_id") -> None:
    """A worker acts only on its own row: named after its runner, and not registered by another runner (nor by a
    database worker). A database worker (TRUSTED) may act on any."""
    protocol.own_worker(caller, worker_id, field=field)
    if not isinstance(caller, credentials.Runner):
        return
    owner = credentials.runner_of(db, worker_id=worker_id)
    if owner is not None and owner != caller.name or owner is None and workers.exists(db, worker_id=worker_id):
        raise Forbidden(f"worker {worker_id!r} is registered by another", field=field)


@protocol.call("tick", body=TickBody, answer=TickPublic)
def tick(db: Session, ctx: Context, body: TickBody) -> TickPublic:
    """A worker's heartbeat, its attempts' lease renewals and their batches, in one transaction; each part answered
    as its own call would answer it."""
    leases, ships, events = _refs(body.leases), _refs(body.ships), _refs(body.events)
    owners = lifecycle.attempt_workers(db, refs=list({*leases, *ships, *events}))
    for field, refs in (("leases", leases), ("ships", ships), ("events", events)):
        for i, ref in enumerate(refs):
            if ref in owners and not ctx.caller.owns(owners[ref]):
                raise Forbidden(f"attempt {ref[1]} (node {ref[2]}) of job {ref[0]} is not runner "
                                f"{ctx.caller.name!r}'s", field=f"{field}.{i}.job_id")
    answer = TickPublic()
    if body.heartbeat is not None:
        own_registered(db, ctx.caller, body.heartbeat.worker_id, field="heartbeat.worker_id")
    jobs = renewals.lock_jobs(db, {ref[0] for ref in owners})
    if body.heartbeat is not None:
        beat = body.heartbeat
        answer.heartbeat = BeatPublic(registered=workers.beat(db, worker_id=beat.worker_id, draining=beat.draining,
                                                              pressure=beat.pressure, devices=beat.devices,
                                                              images=beat.images))
    held = renewals.hold_many(db, [ref for ref in leases if ref in owners], jobs=jobs, lease_s=ctx.settings.lease_s)
    answer.leases = [LeasePublic(**item.model_dump(), held=public_held(held.get(ref)))
                     for item, ref in zip(body.leases, leases, strict=True)]
    fences = renewals.held_many(db, [ref for ref in {*ships, *events} if ref in owners], jobs=jobs)
    sqlite = db.get_bind().dialect.name == "sqlite"
    if sqlite:
        db.commit()  # the heartbeat and the leases, before any batch (see _alone)
    answer.ships = _apply_ships(db, body.ships, [fences.get(ref) for ref in ships], sqlite=sqlite)
    answer.events = [_apply(db, item, fences.get(ref), streams.EVENTS, lambda item=item: apply_event(db, item),
                            sqlite=sqlite) for item, ref in zip(body.events, events, strict=True)]
    db.commit()
    return answer


def _refs(items: list[AttemptRef]) -> list[renewals.Ref]:
    return [(item.job_id, item.attempt, item.node_rank) for item in items]


def _apply_ships(db: Session, items: list[ShipBody], held: list[lifecycle.Held | None], *,
                 sqlite: bool) -> list[Batched]:
    """The tick's batches written together (_write_together) under one savepoint; if the database refuses that,
    each under its own (_apply), so that only the bad one is refused. Nodes that ship twice in one tick (rare) go
    batch by batch too: one statement cannot write a stream's, or a series block's, row twice."""
    live = [(item, fence) for item, fence in zip(items, held, strict=True) if fence is not None]
    nodes = {(item.job_id, item.node_rank) for item, _ in live}
    if live and len(nodes) == len(live):
        try:
            with _alone(db, sqlite=sqlite):
                applied = _write_together(db, live)
        except (TrainjobsError, IntegrityError, DataError):
            pass  # rolled back: batch by batch below
        except UNREACHABLE as exc:
            if not is_refusal(exc):
                raise  # the database away: the whole tick is Unreachable, and the worker sends it again
        else:
            return [Batched(applied=False, lost=True) if fence is None else
                    Batched(applied=(item.job_id, item.attempt, item.node_rank, streams.SHIP) in applied, lost=False)
                    for item, fence in zip(items, held, strict=True)]
    return [_apply(db, item, fence, streams.SHIP, lambda item=item, fence=fence: apply_ship(db, item, fence),
                   sqlite=sqlite) for item, fence in zip(items, held, strict=True)]


def _write_together(db: Session, live: list[tuple[ShipBody, lifecycle.Held]]) -> set[streams.Key]:
    """apply_ship of every batch not applied before, each node's once, by part: one statement advancing every
    stream, one INSERT of the log chunks, one COPY of the points and one upsert of their blocks, one UPDATE of the
    progress that moved; the rarer parts batch by batch. The streams advanced (the batches applied)."""
    applied = streams.advance_many(db, [(item.job_id, item.attempt, item.node_rank, streams.SHIP, item.seq)
                                        for item, _ in live])
    todo = [(item, fence) for item, fence in live
            if (item.job_id, item.attempt, item.node_rank, streams.SHIP) in applied]
    logs.append_many(db, [{"job_id": item.job_id, "attempt": item.attempt, "node_rank": item.node_rank,
                           "start": item.log.start, "seq": item.log.seq, "text": item.log.text}
                          for item, _ in todo if item.log is not None])
    metrics.insert_points_many(db, [(item.job_id, item.attempt, item.node_rank, *_columns(item.points))
                                    for item, _ in todo if item.points])
    for item, _ in todo:
        apply_rare(db, item)
    records.record_progress_many(db, [(item.job_id, item.attempt, item.progress.model_dump(exclude_unset=True))
                                      for item, fence in todo
                                      if item.progress is not None and moves_progress(item, fence)])
    return applied


def _columns(points: list | PointColumns) -> tuple:
    """A batch's points as metrics.insert_points_many's columns (steps, names, name_index, values, times)."""
    if isinstance(points, PointColumns):
        return points.steps, points.names, points.name_index, points.values, points.times
    return metrics.shipped_columns(points)


def _apply(db: Session, item: ShipBody | EventBody, held: lifecycle.Held | None, stream: str,
           write: Callable[[], None], *, sqlite: bool) -> Batched:
    """One batch: nothing once its attempt lost the job, nothing for a sequence number applied before, else applied
    alone (a refusal rolls back this batch only)."""
    if held is None:
        return Batched(applied=False, lost=True)
    try:
        with _alone(db, sqlite=sqlite):
            if not streams.advance(db, job_id=item.job_id, attempt=item.attempt, node_rank=item.node_rank,
                                   stream=stream, seq=item.seq):
                return Batched(applied=False, lost=False)
            write()
    except (TrainjobsError, IntegrityError, DataError) as exc:
        return Batched(applied=False, lost=False, refused=str(exc)[:REFUSED_MAX])
    except UNREACHABLE as exc:
        if not is_refusal(exc):
            raise  # the database away: the whole tick is Unreachable, and the worker sends it again
        return Batched(applied=False, lost=False, refused=str(exc.orig or exc)[:REFUSED_MAX])
    return Batched(applied=True, lost=False)


@contextmanager
def _alone(db: Session, *, sqlite: bool) -> Iterator[None]:
    """A batch's writes undone alone when they fail: a savepoint on PostgreSQL (the tick stays one transaction);
    on SQLite (one machine's embedded database, whose driver does not nest transactions well) a commit each."""
    if not sqlite:
        with db.begin_nested():
            yield
        return
    try:
        yield
    except BaseException:
        db.rollback()
        raise
    db.commit()
