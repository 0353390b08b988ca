"""The RQ job functions: claim a job (or join a gang's node), run one attempt under a supervisor, record it."""

import json
import logging
import os
import socket
import time
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from service.db import UNREACHABLE, is_refusal, make_engine, make_sessionmaker
from service.jobs import lifecycle, queue
from service.scheduling import quota
from service.settings import Settings, get_settings
from service.workers import holds
from service.workers import service as workers
from trainjobs.runenv import SPEC_FILE
from trainjobs.spec import JobSpec
from trainjobs.states import AttemptStatus, ErrorType, JobStatus
from worker import control, devices, gang
from worker.inventory import Offer, probe
from worker.launch import Gang
from worker.root_cause import is_peer_error
from worker.supervisor import Outcome, Supervisor

log = logging.getLogger(__name__)
# Preemption requests in this work-horse (worker/main.py routes the worker's SIGTERM here) and the
# supervisor that acts on them; a request that comes before the supervisor exists is counted, not lost.
_preempt_requests = 0
_supervisor: Supervisor | None = None
offer: Offer | None = None  # what this worker offers (worker/main.py sets it before any work-horse forks)
PEER_GRACE_S = 2.0  # a gang node that failed only because a peer did waits this long before it settles the job


def request_preemption(signum=None, frame=None) -> None:
    """Signal handler: the worker is shutting down, so hand the running job back (twice: stop it now)."""
    global _preempt_requests
    _preempt_requests += 1
    if _supervisor is not None:
        _supervisor.preempt()


def worker_name() -> str:
    return os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}:{os.getppid()}"


def run_job(job_id: str) -> dict:
    """Run one attempt of `job_id` (node 0 of it, for a gang); returns what happened (RQ keeps it as the result)."""
    settings = get_settings()
    engine = make_engine(settings.resolved_database_url, application_name=worker_name())
    sessions = make_sessionmaker(engine)
    try:
        if _preempt_requests:  # shutting down before it began: the job stays queued (the sweeper enqueues it)
            return {"job_id": job_id, "skipped": True}
        claimed = with_retries(lambda: claim(sessions, settings=settings, job_id=job_id), what="claim")
        if claimed is None:
            with_retries(lambda: free_worker(sessions, job_id=job_id, node_rank=0), what="free the worker")
            return {"job_id": job_id, "skipped": True}
        attempt, spec = claimed
        if spec.resources.nnodes > 1:
            redis = Redis.from_url(settings.redis_url)
            try:
                queue.enqueue_nodes(redis, prefix=settings.queue_prefix, job_id=job_id, attempt=attempt,
                                    nnodes=spec.resources.nnodes, timeout_s=spec.timeout_s)
            except RedisError:  # the gang then times out and goes back to the queue
                log.exception("could not enqueue the node tasks of job %s", job_id)
            finally:
                redis.close()
        return run_attempt(sessions, settings=settings, job_id=job_id, attempt=attempt, spec=spec, node_rank=0)
    finally:
        engine.dispose()


def run_node(job_id: str, attempt: int, node_rank: int) -> dict:
    """Join node `node_rank` of a forming gang and run it (RQ's job function for a gang's node task)."""
    settings = get_settings()
    engine = make_engine(settings.resolved_database_url, application_name=worker_name())
    sessions = make_sessionmaker(engine)
    try:
        if _preempt_requests:
            return {"job_id": job_id, "skipped": True}
        spec = with_retries(lambda: gang.join(sessions, settings=settings, job_id=job_id, attempt=attempt,
                                              node_rank=node_rank, worker=worker_name()), what="join")
        if spec is None:
            with_retries(lambda: free_worker(sessions, job_id=job_id, node_rank=node_rank), what="free the worker")
            return {"job_id": job_id, "node_rank": node_rank, "skipped": True}
        return run_attempt(sessions, settings=settings, job_id=job_id, attempt=attempt, spec=spec,
                           node_rank=node_rank)
    finally:
        engine.dispose()


def run_attempt(sessions, *, settings: Settings, job_id: str, attempt: int, spec: JobSpec, node_rank: int) -> dict:
    """One node of one attempt: (a gang waits to form), supervise, record; the worker is free again after."""
    global _supervisor
    me = offer or probe(settings, name=worker_name())
    result = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank}
    try:
        launch_gang = None
        if spec.resources.nnodes > 1:
            endpoint, why = gang.wait_formed(sessions, settings=settings, job_id=job_id, attempt=attempt,
                                             node_rank=node_rank, offer=me, address=me.address,
                                             stopping=lambda: _preempt_requests > 0)
            if endpoint is None:
                return {**result, "status": why}
            launch_gang = Gang(nnodes=spec.resources.nnodes, node_rank=node_rank, endpoint=endpoint,
                               local_addr=me.address, join_timeout_s=max(30.0, settings.gang_timeout_s))
        share = with_retries(lambda: bind_share(sessions, me, job_id=job_id, attempt=attempt, node_rank=node_rank),
                             what="bind the devices")
        run_dir = prepare_run_dir(settings, job_id=job_id, attempt=attempt, spec=spec, node_rank=node_rank)
        supervisor = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=attempt,
                                spec=spec, run_dir=run_dir, gang=launch_gang, share=share,
                                control=control.for_worker(settings, sessions))
        _supervisor = supervisor
        supervisor.preempt_requests = _preempt_requests  # any that came while it was being set up
        try:
            outcome = supervisor.run()
        except Exception as exc:  # a bug or a launch failure: the job must not stay running
            log.exception("supervising job %s failed", job_id)
            outcome = Outcome(JobStatus.FAILED, error={"type": type(exc).__name__, "message": str(exc),
                                                       "rank": None, "where": "supervisor"})
        if launch_gang is not None and outcome.status == JobStatus.FAILED and is_peer_error(outcome.error):
            time.sleep(PEER_GRACE_S)  # the node with the root cause settles the job first: its error is the job's
        with_retries(lambda: record(sessions, job_id=job_id, attempt=attempt, outcome=outcome, node_rank=node_rank),
                     what="record", tries=None)
        return {**result, "status": outcome.status.value}
    finally:
        _supervisor = None
        with_retries(lambda: free_worker(sessions, job_id=job_id, node_rank=node_rank), what="free the worker",
                     tries=None)


def free_worker(sessions, *, job_id: str, node_rank: int | None = None) -> None:
    """Give back what this node of the job held here (its devices), so the worker takes another job."""
    with sessions() as db:
        workers.release(db, worker_id=worker_name(), job_id=job_id, node_rank=node_rank)
        db.commit()


def bind_share(sessions, me: Offer, *, job_id: str, attempt: int, node_rank: int) -> dict | None:
    """The devices the dispatcher took for this node, tied to its attempt; returns its share (worker/devices.py:
    devices, GPU UUIDs, cores), also stored with the attempt. None when it holds none (the whole worker)."""
    with sessions() as db:
        held = holds.bind(db, worker_id=worker_name(), job_id=job_id, node_rank=node_rank, attempt=attempt)
        share = devices.share(me.machine, held) if held and me.machine is not None else None
        if share is not None:
            share["worker"] = worker_name()
            share["of"] = len(me.machine.devices)
            holds.bind(db, worker_id=worker_name(), job_id=job_id, node_rank=node_rank, attempt=attempt,
                       placement=share)
        db.commit()
        return share


def claim(sessions, *, settings: Settings, job_id: str) -> tuple[int, JobSpec] | None:
    """queued → starting, and open the attempt with its lease (service/jobs/lifecycle.py); None when the job is
    not there to take, or would go over its team's or owner's quota (it stays queued and goes back on its queue)."""
    with sessions() as db:
        if (why := quota.over_quota(db, job_id=job_id)) is not None:
            db.rollback()
            log.info("job %s not claimed: %s; back on its queue", job_id, why)
            requeue(sessions, settings, job_id=job_id)
            return None
        claimed = lifecycle.claim(db, job_id=job_id, worker=worker_name(), lease_s=settings.lease_s)
        db.commit()
        return claimed


def requeue(sessions, settings: Settings, *, job_id: str) -> None:
    """Put a queued job's entry back (a claim it could not make now); the reconciler does it too, later."""
    redis = Redis.from_url(settings.redis_url)
    try:
        with sessions() as db:
            queue.put_back(db, redis, prefix=settings.queue_prefix, job_id=job_id)
    except RedisError:
        log.warning("could not put job %s back on its queue; the reconciler will", job_id)
    finally:
        redis.close()


def prepare_run_dir(settings: Settings, *, job_id: str, attempt: int, spec: JobSpec, node_rank: int = 0) -> Path:
    node = f"-node-{node_rank}" if node_rank else ""  # the nodes of a gang may share one data dir
    run_dir = (settings.runs_dir / job_id / f"attempt-{attempt}{node}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SPEC_FILE).write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    return run_dir


def with_retries(fn, *, what: str, tries: int | None = 7, first_s: float = 0.5, max_s: float = 5.0):
    """Retry `fn` while the database is out of reach, backing off from first_s to max_s.

    tries=None: until it answers, however long the outage. That is what an attempt's outcome gets: a finished
    run recorded late is still finished (the sweeper gives a worker one lease after an outage to renew, see
    service/api/sweeper.py), while giving up would leave the job to be retrained.
    """
    i = 0
    while True:
        try:
            return fn()
        except UNREACHABLE as exc:
            i += 1
            if (tries is not None and i >= tries) or is_refusal(exc):  # refused: the same again would be too
                raise
            wait = min(max_s, first_s * 2 ** (i - 1))
            log.warning("%s failed: the database is out of reach (try %d); retrying in %.1fs", what, i, wait,
                        exc_info=i == 1)
            time.sleep(wait)


def record(sessions, *, job_id: str, attempt: int, outcome: Outcome, node_rank: int = 0) -> None:
    """The final compare-and-set; fenced by attempt so a stale worker cannot overwrite a newer one.

    A failure goes through the retry rule (service/jobs/retries.py, in lifecycle.settle_failure): back to
    queued while retries remain and the error is worth another try, else failed; in a gang it stops every
    other node too. A job handed back on shutdown is requeued for free. A success or a cancel is the job's
    once its last node ends.
    """
    with sessions() as db:
        if outcome.status == JobStatus.QUEUED:
            moved = lifecycle.hand_back(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                        detail=outcome.detail or "handed back by its worker")
        elif outcome.status == JobStatus.FAILED:
            # Cut off past its lease, the supervisor stopped its ranks itself: the attempt is lost, as the
            # sweeper would have said (and if its lease somehow still holds, the sweeper says it later).
            lost = (outcome.error or {}).get("type") == ErrorType.WORKER_LOST
            moved = lifecycle.settle_failure(db, job_id=job_id, attempt=attempt, error=outcome.error or {},
                                             attempt_status=AttemptStatus.LOST if lost else AttemptStatus.FAILED,
                                             exit_code=outcome.exit_code, node_rank=node_rank) is not None
        else:
            # A success after retries keeps the earlier attempts' causes in `error`.
            moved = lifecycle.finish_node(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                          status=outcome.status, summary=outcome.summary, error=outcome.error,
                                          exit_code=outcome.exit_code)
        db.commit()
    if not moved:
        log.warning("job %s attempt %s node %s: outcome %s not recorded (the job moved on)", job_id, attempt,
                    node_rank, outcome.status)
