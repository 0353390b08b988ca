"""The worker protocol's `tick` (issue 42, docs/architecture.md "The worker protocol"): one request per worker per
tick carrying its heartbeat, the leases of every attempt it runs and every batch they ship, written in one
transaction.

The worker's relay (worker/tick.py) gathers what its attempts' supervisors send within a tick and sends it as one
call; the answer is split back to each. Before, a worker with 8 running attempts sent a heartbeat, 8 lease renewals
(each its own transaction: a lock, an UPDATE, a commit) and up to 8 ships per tick, each paying the API's fixed
cost of a request (bench/README.md "The worker protocol").

In the transaction: the caller's ownership of every attempt named (one SELECT; another runner's is a 403 naming the
item), the heartbeat, the jobs' rows locked in id order (service/jobs/renewals.py), every lease renewed in one
UPDATE, every batch's fence read in one SELECT, then each batch applied as `ship` would apply it, idempotent by its
sequence number. A batch the database refuses (bad data) is rolled back alone (a savepoint) and answered `refused`:
one attempt's bad batch never keeps another's from being stored. One commit.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from pydantic import BaseModel, Field
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from service.db import UNREACHABLE, is_refusal
from service.errors import Forbidden, TrainjobsError
from service.jobs import lifecycle, renewals
from service.runners import credentials, protocol, streams
from service.runners.attempt_calls import AttemptRef, LeasePublic, public_held
from service.runners.protocol import Caller, Context
from service.runners.ship_calls import Acknowledged, EventBody, ShipBody, apply_event, apply_ship
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
    answer.ships = [_apply(db, item, fences.get(ref), streams.SHIP, lambda item=item, ref=ref: apply_ship(
        db, item, fences[ref]), sqlite=sqlite) for item, ref in zip(body.ships, ships, strict=True)]
    answer.events = [_apply(db, item, fences.get(ref), streams.EVENTS, lambda item=item: apply_event(db, item),
                            sqlite=sqlite) for item, ref in zip(body.events, events, strict=True)]
    db.commit()
    return answer


def _refs(items: list[AttemptRef]) -> list[renewals.Ref]:
    return [(item.job_id, item.attempt, item.node_rank) for item in items]


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
