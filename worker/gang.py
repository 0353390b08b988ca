"""A multi-node job's gang: nodes join by compare-and-set, wait for each other, and form, time out or yield together.

Node 0 is whoever claims the job (worker/agent.py); it enqueues one task per other node (service/queue.py),
and a worker that fits takes one and joins: it inserts its node's attempt row under the job's row lock,
while the job is still `starting` at that attempt (the unique (job, attempt, node) makes a second join of
the same node fail). Every member renews its lease while it waits. Once all nodes are in, node 0 picks a
free port on its reachable address, records the endpoint and moves the job to `running` in one
compare-and-set; then every node launches torchrun against that endpoint.

No worker waits forever: a gang not formed within TRAINJOBS_GANG_TIMEOUT_S releases its workers and goes
back to the queue. Two half-formed gangs cannot deadlock: the younger one (started later) yields to an older
one that still lacks nodes this worker could fill, so the oldest gang always gets every worker it needs.
"""

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.db import utcnow
from service.jobs import retries
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.settings import Settings
from service.workers import fit
from service.workers import service as workers
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
LIVE = (JobStatus.STARTING, JobStatus.RUNNING)


def free_port(address: str) -> int:
    """A port free on `address` now (torchrun on node 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def join(sessions: sessionmaker[Session], *, settings: Settings, job_id: str, attempt: int, node_rank: int,
         worker: str) -> JobSpec | None:
    """Take node `node_rank` of the gang forming for `attempt`; None when it formed, moved on or is taken."""
    with sessions() as db:
        job = db.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one_or_none()
        if (job is None or job.status != JobStatus.STARTING or job.attempt != attempt
                or job.cancel_requested_at is not None):
            log.info("node task %s/%s/%s skipped (the job moved on)", job_id, attempt, node_rank)
            return None
        spec = JobSpec.model_validate(job.spec)
        db.add(Attempt(job_id=job_id, number=attempt, worker=worker, node_rank=node_rank, started_at=utcnow(),
                       lease_expires_at=utcnow() + timedelta(seconds=settings.lease_s)))
        try:
            db.flush()
        except IntegrityError:  # that node is taken already
            db.rollback()
            return None
        workers.occupy(db, worker_id=worker, job_id=job_id, slots=spec.resources.nproc_per_node)
        jobs.record_event(db, job_id=job_id, kind="node_joined", detail=f"node {node_rank} on {worker}")
        db.commit()
        return spec


def wait_formed(sessions: sessionmaker[Session], *, settings: Settings, job_id: str, attempt: int, node_rank: int,
                offer: fit.Offer, address: str, stopping: Callable[[], bool] = lambda: False) -> tuple[str | None, str]:
    """Wait for the whole gang: (endpoint, "formed"), else (None, why): lost | cancelled | timeout | yielded |
    preempted (this worker is shutting down: the gang lets go and goes back to the queue)."""
    while True:
        with sessions() as db:
            endpoint, why = check(db, settings=settings, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                  offer=offer, address=address)
            if why == "waiting" and stopping():
                release(db, job_id=job_id, attempt=attempt, why=f"node {node_rank}'s worker is shutting down")
                endpoint, why = None, "preempted"
            db.commit()
        if why != "waiting":
            return endpoint, why
        time.sleep(settings.poll_s)


def check(db: Session, *, settings: Settings, job_id: str, attempt: int, node_rank: int, offer: fit.Offer,
          address: str) -> tuple[str | None, str]:
    """One look at the gang, under the job's row lock; renews this node's lease. The caller commits."""
    job = db.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one_or_none()
    if job is None or job.attempt != attempt or job.status not in LIVE:
        return None, "lost"
    renewed = db.execute(update(Attempt).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.node_rank == node_rank,
        Attempt.status == "active").values(lease_expires_at=utcnow() + timedelta(seconds=settings.lease_s)))
    if renewed.rowcount != 1:
        return None, "lost"
    if job.cancel_requested_at is not None:
        if jobs.transition(db, job_id=job_id, to=JobStatus.CANCELLED, attempt=attempt,
                           detail="cancelled while its gang was forming"):
            retries.close_gang(db, job_id=job_id, attempt=attempt, why="cancelled", status="cancelled")
        return None, "cancelled"
    if job.status == JobStatus.RUNNING:
        return db.scalar(select(Attempt.endpoint).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                                         Attempt.node_rank == 0)), "formed"
    nnodes = job.spec["resources"]["nnodes"]
    members = db.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.job_id == job_id, Attempt.number == attempt, Attempt.status == "active"))
    waited = (utcnow() - job.started_at).total_seconds()
    if node_rank == 0 and members == nnodes:
        endpoint = f"{address}:{free_port(address)}"
        db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt, Attempt.node_rank == 0)
                   .values(endpoint=endpoint))
        jobs.transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=attempt,
                        detail=f"gang of {nnodes} formed in {waited:.1f}s; rendezvous at {endpoint}")
        return endpoint, "formed"
    if waited > settings.gang_timeout_s:
        release(db, job_id=job_id, attempt=attempt,
                why=f"gang not formed in {settings.gang_timeout_s:g}s ({members} of {nnodes} nodes)")
        return None, "timeout"
    older = older_forming_gang(db, job=job, offer=offer)
    if older is not None:
        release(db, job_id=job_id, attempt=attempt, why=f"yielded its workers to the older forming gang {older}")
        return None, "yielded"
    return None, "waiting"


def release(db: Session, *, job_id: str, attempt: int, why: str) -> bool:
    """The gang did not form: every node lets go, and the job goes back to the queue (no retry spent)."""
    if not retries.release_gang(db, job_id=job_id, attempt=attempt, why=why):
        return False
    log.info("job %s attempt %s: %s", job_id, attempt, why)
    return True


def older_forming_gang(db: Session, *, job: Job, offer: fit.Offer) -> str | None:
    """A gang that began forming before this one, still lacks nodes, and could use this worker."""
    for other in db.scalars(select(Job).where(Job.status == JobStatus.STARTING, Job.id != job.id,
                                              Job.started_at <= job.started_at)):
        if (other.started_at, other.id) >= (job.started_at, job.id):
            continue
        need = fit.need_of(other.spec, other.plan)
        if need.nodes < 2 or fit.misfit(need, offer) is not None:
            continue
        members = db.scalar(select(func.count()).select_from(Attempt).where(
            Attempt.job_id == other.id, Attempt.number == other.attempt, Attempt.status == "active"))
        if members < need.nodes:
            return other.id
    return None
