"""The worker protocol's calls on a gang's node tasks (issue 42): a worker looks at the gang queue's entries and takes
one it fits, without reading the database itself.

A forming gang's node tasks wait on the gang queue (service/jobs/queue.py enqueue_nodes) for any worker that fits
one; the scheduler's pass does not assign them yet. `node_tasks` says which entries are stale (their attempt gone
by) and which this worker fits (the job's needs against the worker's row, and a shared worker takes no second node
of one job); `node_hold` takes the devices one node task needs on this worker (placement's best linked free set of
its row's healthy devices), or none when too few are free now. Both are the worker/dispatch.py logic they replace,
run where the database is.
"""

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs import service as jobs
from service.jobs.queue import parse_node_task_id
from service.runners import protocol
from service.runners.protocol import Context
from service.scheduling import placement
from service.scheduling import service as scheduling
from service.workers import fit, holds
from service.workers.models import Worker
from trainjobs.states import JobStatus

ENTRIES_MAX = 1000  # node tasks a worker looks at in one call (worker/dispatch.py SCAN)


class NodeTasksBody(BaseModel):
    worker_id: str = Field(max_length=256)
    entries: list[str] = Field(max_length=ENTRIES_MAX)


class NodeFit(BaseModel):
    entry: str
    slots: int


class NodeTasks(BaseModel):
    stale: list[str] = Field(description="node tasks whose attempt is gone by: remove them, unrun")
    fits: list[NodeFit] = Field(description="those this worker may take, in queue order, with the slots each needs")


class NodeHoldBody(BaseModel):
    worker_id: str = Field(max_length=256)
    job_id: str = Field(max_length=32)
    node_rank: int = Field(ge=1, le=4096)
    slots: int = Field(ge=1, le=4096)


class NodeHeld(BaseModel):
    taken: bool
    devices: list[int] | None = Field(None, description="the devices held for the node (None: the whole worker)")
    reason: str | None = None


@protocol.call("node_tasks", body=NodeTasksBody, answer=NodeTasks)
def node_tasks(db: Session, ctx: Context, body: NodeTasksBody) -> NodeTasks:
    """Of the gang queue's entries: the stale ones, and those this worker fits, in queue order."""
    protocol.own_worker(ctx.caller, body.worker_id)
    worker = db.get(Worker, body.worker_id)
    keys = {e: parse_node_task_id(e) for e in body.entries}
    rows = jobs.dispatch_view(db, job_ids={k[0] for k in keys.values() if k})
    # A node of a gang is a machine: a shared worker that runs one node of a job takes no other node of it.
    here = {job for job, _ in holds.held(db, worker_id=body.worker_id).values()} \
        if worker is not None and worker.max_jobs > 1 else set()
    stale, fits = [], []
    for entry, key in keys.items():
        row = rows.get(key[0]) if key else None
        if row is None or row.status != JobStatus.STARTING or row.attempt != key[1]:
            stale.append(entry)
        elif worker is None or key[0] in here:
            continue
        elif fit.misfit(need := fit.need_of(row.spec, row.plan), worker) is None:
            fits.append(NodeFit(entry=entry, slots=need.slots))
    return NodeTasks(stale=stale, fits=fits)


@protocol.call("node_hold", body=NodeHoldBody, answer=NodeHeld)
def node_hold(db: Session, ctx: Context, body: NodeHoldBody) -> NodeHeld:
    """Take this worker's devices for a gang node task: the best linked free set of its healthy devices (as its
    heartbeat last reported them), or `taken: false` when too few are free now (its entry goes back). A worker
    whose row names no devices holds the whole worker."""
    protocol.own_worker(ctx.caller, body.worker_id)
    found = db.execute(select(Worker.device, Worker.devices).where(Worker.id == body.worker_id)).first()
    machine = scheduling.machine_of(body.worker_id, found.device, found.devices) if found is not None else None
    if machine is None:
        return NodeHeld(taken=True)
    mine = holds.held(db, worker_id=body.worker_id)
    already = sorted(d for d, (job, node) in mine.items() if job == body.job_id and node == body.node_rank)
    if already:  # a replay after a lost answer: what it took then
        return NodeHeld(taken=True, devices=already)
    free = {d.index for d in machine.devices if d.healthy} - set(mine)
    chosen = placement.choose(machine, free, body.slots)
    if chosen is None:
        return NodeHeld(taken=False, reason=f"{len(free)} of {body.slots} device(s) free on {body.worker_id} now")
    taken = holds.take(db, worker_id=body.worker_id, job_id=body.job_id, node_rank=body.node_rank,
                       devices=list(chosen))
    db.commit()
    return NodeHeld(taken=bool(taken), devices=list(chosen) if taken else None,
                    reason=None if taken else "a sibling lane took them first")
