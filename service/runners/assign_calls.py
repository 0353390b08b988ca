"""The worker protocol's calls on assignments (issue 42, step 5): what a worker says of the jobs assigned to it.

The control plane's scheduling pass (service/jobs/assigner.py) assigns a job to a worker and its devices and puts
its entry on that worker's own queue; the worker takes it off and asks `assignment` whether it still is its to run
and still fits (its devices healthy, held for it). One that does not is given back here at once, as `give_back`
does for a worker that cannot take it now (its disk full, shutting down): its unclaimed holds released, its entry
back on its priority queue, and a pass kicked to plan it again.
"""

import logging

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import queue
from service.jobs.models import Job
from service.runners import protocol
from service.runners.protocol import Context
from service.scheduling import assign
from service.scheduling.assignments import Assignment
from service.workers import holds
from service.workers import service as workers
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)


class AssignmentRef(BaseModel):
    worker_id: str = Field(max_length=256)
    job_id: str = Field(max_length=32)


class GiveBackBody(AssignmentRef):
    reason: str = Field("", max_length=500)


class Assigned(BaseModel):
    """`run`: the worker runs it (claims it) on `devices` (None: the whole worker); `stale`: nothing to run (its
    job is no longer queued, or not assigned to this worker): the entry goes, unrun; `given back`: it no longer
    fits here (`reason`) and was planned again."""

    job_id: str
    state: str
    node_rank: int = 0
    devices: list[int] | None = None
    reason: str | None = None


@protocol.call("assignment", body=AssignmentRef, answer=Assigned)
def assignment(db: Session, ctx: Context, body: AssignmentRef) -> Assigned:
    """A worker took a job's entry off its own queue: is it still its assignment, and does it still fit?"""
    protocol.own_worker(ctx.caller, body.worker_id)
    row = db.scalar(select(Assignment).where(Assignment.job_id == body.job_id, Assignment.node_rank == 0))
    status = db.scalar(select(Job.status).where(Job.id == body.job_id))
    if status != JobStatus.QUEUED or row is None or row.worker_id != body.worker_id:
        return Assigned(job_id=body.job_id, state="stale",
                        reason=f"job {body.job_id} is {status or 'unknown'}" if status != JobStatus.QUEUED
                        else f"job {body.job_id} is not assigned to {body.worker_id}")
    why = misfit(db, row)
    if why is not None:
        undo(db, ctx, row, why)
        return Assigned(job_id=body.job_id, state="given back", reason=why)
    row.taken_at = row.taken_at or utcnow()  # claiming it: the pass leaves it be (holds.PENDING_S at most)
    db.commit()
    return Assigned(job_id=body.job_id, state="run", node_rank=row.node_rank, devices=row.devices)


@protocol.call("give_back", body=GiveBackBody)
def give_back(db: Session, ctx: Context, body: GiveBackBody) -> None:
    """A worker cannot run a job assigned to it now (`reason`): it is planned again. Idempotent."""
    protocol.own_worker(ctx.caller, body.worker_id)
    row = db.scalar(select(Assignment).where(Assignment.job_id == body.job_id, Assignment.node_rank == 0,
                                             Assignment.worker_id == body.worker_id))
    if row is not None:
        undo(db, ctx, row, body.reason or "given back by its worker")


def misfit(db: Session, row: Assignment) -> str | None:
    """Why an assignment no longer fits its worker: a device of it unhealthy (as its heartbeat last said) or no
    longer held for its job; None when it fits."""
    if row.devices is None:
        return None
    health = {d["index"]: d.get("healthy", True) for d in workers.device_rows(db, worker_id=row.worker_id)}
    sick = [d for d in row.devices if not health.get(d, True)]
    if sick:
        return f"device(s) {sick} of {row.worker_id} turned unhealthy"
    held = holds.held(db, worker_id=row.worker_id)
    lost = [d for d in row.devices if held.get(d, (None, None))[0] != row.job_id]
    return f"device(s) {lost} of {row.worker_id} are no longer held for it" if lost else None


def undo(db: Session, ctx: Context, row: Assignment, why: str) -> None:
    """The assignment goes, its unclaimed holds too; its entry back on its priority queue, a pass kicked."""
    log.info("job %s: its assignment to %s is given back (%s)", row.job_id, row.worker_id, why)
    worker_id = row.worker_id
    assign.forget(db, assign.Open(row.job_id, row.node_rank, worker_id, None, row.attempt, row.pass_no,
                                  row.assigned_at, row.taken_at, None, None, None), release=True)
    db.commit()
    queue.off_worker_queue(ctx.redis, prefix=ctx.settings.queue_prefix, job_id=row.job_id, worker_id=worker_id)
    queue.put_back(db, ctx.redis, prefix=ctx.settings.queue_prefix, job_id=row.job_id)
