"""The RQ job functions: claim a job (or join a gang's node), run one attempt under a supervisor, record it."""

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, is_refusal, make_engine, make_sessionmaker
from service.settings import Settings, get_settings
from trainjobs.runenv import SPEC_FILE
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import control as worker_control
from worker import devices, gang
from worker.control import Control
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
    sessions, control, close = reach(settings)  # the protocol's calls: the API, or in-process
    try:
        if _preempt_requests:  # shutting down before it began: the job stays queued (the sweeper enqueues it)
            return {"job_id": job_id, "skipped": True}
        claimed = with_retries(lambda: claim(control, job_id=job_id), what="claim")
        if claimed is None:
            with_retries(lambda: free_worker(control, job_id=job_id, node_rank=0), what="free the worker")
            return {"job_id": job_id, "skipped": True}
        attempt, spec = claimed
        return run_attempt(sessions, control, settings=settings, job_id=job_id, attempt=attempt, spec=spec,
                           node_rank=0)
    except worker_control.Revoked as exc:
        return revoked(job_id, exc)
    finally:
        close()


def run_node(job_id: str, attempt: int, node_rank: int) -> dict:
    """Join node `node_rank` of a forming gang and run it (RQ's job function for a gang's node task)."""
    settings = get_settings()
    sessions, control, close = reach(settings)
    try:
        if _preempt_requests:
            return {"job_id": job_id, "skipped": True}
        spec = with_retries(lambda: gang.join(control, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                              worker=worker_name()), what="join")
        if spec is None:
            with_retries(lambda: free_worker(control, job_id=job_id, node_rank=node_rank), what="free the worker")
            return {"job_id": job_id, "node_rank": node_rank, "skipped": True}
        return run_attempt(sessions, control, settings=settings, job_id=job_id, attempt=attempt, spec=spec,
                           node_rank=node_rank)
    except worker_control.Revoked as exc:
        return revoked(job_id, exc)
    finally:
        close()


def reach(settings: Settings) -> tuple[sessionmaker[Session] | None, Control, Callable[[], None]]:
    """How this work-horse reaches the control plane: a joined worker through the API alone (no database URL, no
    session); else the database, on an engine of its own (named after the worker: the sweeper ends a frozen
    worker's sessions by that name). And what closes it."""
    if settings.worker_api:
        control = worker_control.for_worker(settings, None)
        return None, control, getattr(control, "close", lambda: None)
    engine = make_engine(settings.resolved_database_url, application_name=worker_name())
    sessions = make_sessionmaker(engine)
    return sessions, worker_control.for_worker(settings, sessions), engine.dispose


def revoked(job_id: str, exc: worker_control.Revoked) -> dict:
    """The API refused this machine's credential: the revocation took its jobs back already; nothing to record."""
    log.error("job %s: the API revoked this machine's credential (%s); the API handed its jobs back", job_id, exc)
    return {"job_id": job_id, "status": "revoked"}


def run_attempt(sessions, control: Control, *, settings: Settings, job_id: str, attempt: int, spec: JobSpec,
                node_rank: int) -> dict:
    """One node of one attempt: (a gang waits to form), supervise, record; the worker is free again after."""
    global _supervisor
    me = offer or probe(settings, name=worker_name())
    result = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank}
    try:
        launch_gang = None
        if spec.resources.nnodes > 1:
            endpoint, why = gang.wait_formed(control, settings=settings, job_id=job_id, attempt=attempt,
                                             node_rank=node_rank, offer=me, address=me.address,
                                             stopping=lambda: _preempt_requests > 0)
            if endpoint is None:
                return {**result, "status": why}
            launch_gang = Gang(nnodes=spec.resources.nnodes, node_rank=node_rank, endpoint=endpoint,
                               local_addr=me.address, join_timeout_s=max(30.0, settings.gang_timeout_s))
        share = with_retries(lambda: bind_share(control, me, job_id=job_id, attempt=attempt, node_rank=node_rank),
                             what="bind the devices")
        run_dir = prepare_run_dir(settings, job_id=job_id, attempt=attempt, spec=spec, node_rank=node_rank)
        supervisor = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=attempt,
                                spec=spec, run_dir=run_dir, gang=launch_gang, share=share, control=control)
        _supervisor = supervisor
        supervisor.preempt_requests = _preempt_requests  # any that came while it was being set up
        try:
            outcome = supervisor.run()
        except worker_control.Revoked:
            raise
        except Exception as exc:  # a bug or a launch failure: the job must not stay running
            log.exception("supervising job %s failed", job_id)
            outcome = Outcome(JobStatus.FAILED, error={"type": type(exc).__name__, "message": str(exc),
                                                       "rank": None, "where": "supervisor"})
        if launch_gang is not None and outcome.status == JobStatus.FAILED and is_peer_error(outcome.error):
            time.sleep(PEER_GRACE_S)  # the node with the root cause settles the job first: its error is the job's
        with_retries(lambda: record(control, job_id=job_id, attempt=attempt, outcome=outcome, node_rank=node_rank),
                     what="record", tries=None)
        return {**result, "status": outcome.status.value}
    finally:
        _supervisor = None
        with_retries(lambda: free_worker(control, job_id=job_id, node_rank=node_rank), what="free the worker",
                     tries=None)


def free_worker(control: Control, *, job_id: str, node_rank: int | None = None) -> None:
    """Give back what this node of the job held here (its devices), so the worker takes another job."""
    control.call("free", {"job_id": job_id, "worker_id": worker_name(), "node_rank": node_rank})


def bind_share(control: Control, me: Offer, *, job_id: str, attempt: int, node_rank: int) -> dict | None:
    """The devices the dispatcher took for this node, tied to its attempt; returns its share (worker/devices.py:
    devices, GPU UUIDs, cores), also stored with the attempt. None when it holds none (the whole worker)."""
    ref = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "worker_id": worker_name()}
    held = control.call("bind", ref)["devices"]
    share = devices.share(me.machine, held) if held and me.machine is not None else None
    if share is not None:
        share["worker"] = worker_name()
        share["of"] = len(me.machine.devices)
        control.call("bind", {**ref, "placement": share})
    return share


def claim(control: Control, *, job_id: str) -> tuple[int, JobSpec] | None:
    """queued → starting, and open the attempt with its lease (the protocol's `claim`); None when the job is not
    there to take, or would go over its team's or owner's quota (it stays queued and goes back on its queue)."""
    answer = control.call("claim", {"job_id": job_id, "worker_id": worker_name()})
    if not answer["claimed"]:
        log.info("job %s not claimed: %s", job_id, answer["why"])
        return None
    return answer["attempt"], JobSpec.model_validate(answer["spec"])


def prepare_run_dir(settings: Settings, *, job_id: str, attempt: int, spec: JobSpec, node_rank: int = 0) -> Path:
    node = f"-node-{node_rank}" if node_rank else ""  # the nodes of a gang may share one data dir
    run_dir = (settings.runs_dir / job_id / f"attempt-{attempt}{node}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SPEC_FILE).write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    return run_dir


def with_retries(fn, *, what: str, tries: int | None = 7, first_s: float = 0.5, max_s: float = 5.0):
    """Retry `fn` while the control plane (the API, or the database) is out of reach, backing off from first_s to
    max_s. A refusal (worker_control.Refused, or the database refusing the statement) is raised at once: the same
    again would be refused again; so is a revoked credential (worker_control.Revoked).

    tries=None: until it answers, however long the outage. That is what an attempt's outcome gets: a finished
    run recorded late is still finished (the sweeper gives a worker one lease after an outage to renew, see
    service/api/sweeper.py), while giving up would leave the job to be retrained. Each call the protocol carries
    answers a replay as the first time, so a call whose answer was lost is sent again safely.
    """
    i = 0
    while True:
        try:
            return fn()
        except (worker_control.Unreachable, *UNREACHABLE) as exc:
            i += 1
            if (tries is not None and i >= tries) or (isinstance(exc, UNREACHABLE) and is_refusal(exc)):
                raise
            wait = min(max_s, first_s * 2 ** (i - 1))
            log.warning("%s failed: the control plane is out of reach (try %d); retrying in %.1fs", what, i, wait,
                        exc_info=i == 1)
            time.sleep(wait)


def record(control: Control, *, job_id: str, attempt: int, outcome: Outcome, node_rank: int = 0) -> None:
    """The final compare-and-set (the protocol's `outcome`); fenced by attempt so a stale worker cannot overwrite a
    newer one.

    A failure goes through the retry rule (service/jobs/retries.py, in lifecycle.settle_failure): back to
    queued while retries remain and the error is worth another try, else failed; in a gang it stops every
    other node too. A job handed back on shutdown is requeued for free. A success or a cancel is the job's
    once its last node ends.
    """
    answer = control.call("outcome", {"job_id": job_id, "attempt": attempt, "node_rank": node_rank,
                                      "status": outcome.status.value, "exit_code": outcome.exit_code,
                                      "error": outcome.error, "summary": outcome.summary, "detail": outcome.detail})
    if not answer["recorded"]:
        log.warning("job %s attempt %s node %s: outcome %s not recorded (the job moved on)", job_id, attempt,
                    node_rank, outcome.status)
