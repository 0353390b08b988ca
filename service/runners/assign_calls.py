"""The worker protocol's calls on assignments (issue 42, step 5): what a worker says of the jobs assigned to it.

The control plane's scheduling pass (service/jobs/assigner.py) assigns a job to a worker and its devices (a gang:
each node to a worker) and puts its entry on that worker's own queue; the worker takes it off and asks
`assignment` whether it still is its to run and still fits (its devices healthy, held for it). One that does not is
given back here at once, as `give_back` does for a worker that cannot take it now (its disk full, shutting down):
every node's assignment of its job undone with their unclaimed holds, a gang forming on them released, its entry
back on its priority queue, and a pass kicked to plan it again. A gang's node 1.. (a node task, the attempt node 0
claimed) is judged by node_calls.py.
"""

import logging

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.errors import InvalidRequest
from service.jobs import assigner, queue
from service.jobs.models import Job
from service.runners import node_calls, protocol
from service.runners.protocol import Context
from service.scheduling import assign
from service.scheduling.assignments import Assignment
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)


class AssignmentRef(BaseModel):
    worker_id: str = Field(max_length=256)
    job_id: str = Field(max_length=32)
    node_rank: int = Field(0, ge=0, le=4096, description="a gang's node 1..: its node task; 0: the job")
    attempt: int | None = Field(None, ge=1, le=2**31 - 1, description="a gang's node 1..: the attempt its node "
                                "task names (the one node 0 claimed)")

    def node_task(self) -> bool:
        if self.node_rank > 0 and self.attempt is None:
            raise InvalidRequest("a gang's node task names its attempt: send attempt", field="attempt")
        return self.node_rank > 0


class GiveBackBody(AssignmentRef):
    reason: str = Field("", max_length=500)


class Assigned(BaseModel):
    """`run`: the worker runs it (claims the job, or joins the gang as its node) on `devices` (None: the whole
    worker); `stale`: nothing to run (its job is no longer queued or its gang no longer forming at that attempt, or
    it is not assigned to this worker): the entry goes, unrun; `given back`: it no longer fits here (`reason`) and
    was planned again."""

    job_id: str
    state: str
    node_rank: int = 0
    devices: list[int] | None = None
    reason: str | None = None


@protocol.call("assignment", body=AssignmentRef, answer=Assigned)
def assignment(db: Session, ctx: Context, body: AssignmentRef) -> Assigned:
    """A worker took a job's entry (a gang node's task) off its own queue: still its assignment, still fits?"""
    protocol.own_worker(ctx.caller, body.worker_id)
    if body.node_task():
        row, stale = node_calls.assigned_node(db, worker_id=body.worker_id, job_id=body.job_id,
                                              node_rank=body.node_rank, attempt=body.attempt)
    else:
        row = db.scalar(select(Assignment).where(Assignment.job_id == body.job_id, Assignment.node_rank == 0))
        status = db.scalar(select(Job.status).where(Job.id == body.job_id))
        stale = (f"job {body.job_id} is {status or 'unknown'}" if status != JobStatus.QUEUED
                 else f"job {body.job_id} is not assigned to {body.worker_id}"
                 if row is None or row.worker_id != body.worker_id else None)
    if stale is not None:
        return Assigned(job_id=body.job_id, state="stale", node_rank=body.node_rank, reason=stale)
    why = assign.misfit(db, row)
    if why is not None:
        undo(db, ctx, row, why)
        return Assigned(job_id=body.job_id, state="given back", node_rank=body.node_rank, reason=why)
    row.taken_at = row.taken_at or utcnow()  # claiming (joining) it: the pass leaves it be (holds.PENDING_S at most)
    db.commit()
    return Assigned(job_id=body.job_id, state="run", node_rank=row.node_rank, devices=row.devices)


@protocol.call("give_back", body=GiveBackBody)
def give_back(db: Session, ctx: Context, body: GiveBackBody) -> None:
    """A worker cannot run a job (a gang's node) assigned to it now (`reason`): it is planned again. Idempotent."""
    protocol.own_worker(ctx.caller, body.worker_id)
    if body.node_task():
        row, stale = node_calls.assigned_node(db, worker_id=body.worker_id, job_id=body.job_id,
                                              node_rank=body.node_rank, attempt=body.attempt)
        row = None if stale is not None else row
    else:
        row = db.scalar(select(Assignment).where(Assignment.job_id == body.job_id, Assignment.node_rank == 0,
                                                 Assignment.worker_id == body.worker_id))
    if row is not None:
        undo(db, ctx, row, body.reason or "given back by its worker")


def undo(db: Session, ctx: Context, row: Assignment, why: str) -> None:
    """Every node's assignment of the job goes, their unclaimed holds too (a gang forming on them is released);
    its entry back on its priority queue, a pass kicked."""
    log.info("job %s: its assignment of node %d to %s is given back (%s)", row.job_id, row.node_rank, row.worker_id,
             why)
    job_id, why = row.job_id, why if row.node_rank == 0 else f"node {row.node_rank} on {row.worker_id}: {why}"
    assigner.undo_job(db, ctx.redis, prefix=ctx.settings.queue_prefix, job_id=job_id, why=why)
    queue.kick(ctx.redis, prefix=ctx.settings.queue_prefix)
