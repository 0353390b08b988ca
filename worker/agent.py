"""The RQ job function: claim the job, run one attempt under a supervisor, record the outcome."""

import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import or_
from sqlalchemy.exc import OperationalError

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import retries
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.jobs.spec import JobSpec
from service.jobs.status import JobStatus
from service.settings import Settings, get_settings
from worker.launch import SPEC_FILE
from worker.supervisor import Outcome, Supervisor

log = logging.getLogger(__name__)
# Preemption requests in this work-horse (worker/main.py routes the worker's SIGTERM here) and the
# supervisor that acts on them; a request that comes before the supervisor exists is counted, not lost.
_preempt_requests = 0
_supervisor: Supervisor | None = None


def request_preemption(signum=None, frame=None) -> None:
    """Signal handler: the worker is shutting down, so hand the running job back (twice: stop it now)."""
    global _preempt_requests
    _preempt_requests += 1
    if _supervisor is not None:
        _supervisor.preempt()


def worker_name() -> str:
    return os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}:{os.getppid()}"


def run_job(job_id: str) -> dict:
    """Run one attempt of `job_id`; returns what happened (RQ keeps it as the result)."""
    global _supervisor
    settings = get_settings()
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    try:
        if _preempt_requests:  # shutting down before it began: the job stays queued (the sweeper enqueues it)
            return {"job_id": job_id, "skipped": True}
        claimed = with_retries(lambda: claim(sessions, settings=settings, job_id=job_id), what="claim")
        if claimed is None:
            return {"job_id": job_id, "skipped": True}
        attempt, spec = claimed
        run_dir = prepare_run_dir(settings, job_id=job_id, attempt=attempt, spec=spec)
        supervisor = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=attempt,
                                spec=spec, run_dir=run_dir)
        _supervisor = supervisor
        supervisor.preempt_requests = _preempt_requests  # any that came while it was being set up
        try:
            outcome = supervisor.run()
        except Exception as exc:  # a bug or a launch failure: the job must not stay running
            log.exception("supervising job %s failed", job_id)
            outcome = Outcome(JobStatus.FAILED, error={"type": type(exc).__name__, "message": str(exc),
                                                       "rank": None, "where": "supervisor"})
        with_retries(lambda: record(sessions, job_id=job_id, attempt=attempt, outcome=outcome), what="record")
        return {"job_id": job_id, "attempt": attempt, "status": outcome.status.value}
    finally:
        _supervisor = None
        engine.dispose()


def claim(sessions, *, settings: Settings, job_id: str) -> tuple[int, JobSpec] | None:
    """queued → starting by compare-and-set, and open the attempt with its lease."""
    with sessions() as db:
        moved = jobs.transition(
            db, job_id=job_id, to=JobStatus.STARTING, detail=f"claimed by {worker_name()}",
            values={"attempt": Job.attempt + 1, "started_at": utcnow()},
            # NOTE: a retry dequeued before its backoff ended is left for the sweeper to enqueue again.
            where=[Job.cancel_requested_at.is_(None), or_(Job.not_before.is_(None), Job.not_before <= utcnow())],
        )
        if not moved:
            job = db.get(Job, job_id)
            if job is not None and job.status == JobStatus.QUEUED and job.cancel_requested_at is not None:
                jobs.transition(db, job_id=job_id, to=JobStatus.CANCELLED, detail="cancelled before start")
                db.commit()
            log.info("job %s not claimed (status %s)", job_id, job.status if job else "unknown")
            return None
        job = db.get(Job, job_id)
        db.add(Attempt(job_id=job_id, number=job.attempt, worker=worker_name(), node_rank=0,
                       started_at=utcnow(), lease_expires_at=utcnow() + timedelta(seconds=settings.lease_s)))
        db.commit()
        return job.attempt, JobSpec.model_validate(job.spec)


def prepare_run_dir(settings: Settings, *, job_id: str, attempt: int, spec: JobSpec) -> Path:
    run_dir = (settings.runs_dir / job_id / f"attempt-{attempt}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SPEC_FILE).write_text(json.dumps(spec.model_dump(mode="json"), indent=2))
    return run_dir


def with_retries(fn, *, what: str, tries: int = 7, first_s: float = 0.5):
    """A database blip must not turn a finished run into a lost one: retry with backoff (0.5 s … 16 s)."""
    for i in range(tries):
        try:
            return fn()
        except OperationalError:
            if i == tries - 1:
                raise
            log.warning("%s failed on a database error; retrying in %.1fs", what, first_s * 2**i, exc_info=True)
            time.sleep(first_s * 2**i)


def record(sessions, *, job_id: str, attempt: int, outcome: Outcome) -> None:
    """The final compare-and-set; fenced by attempt so a stale worker cannot overwrite a newer one.

    A failure goes through the retry rule (service/jobs/retries.py): back to queued while retries remain
    and the error is worth another try, else failed. A job handed back on shutdown is requeued for free.
    """
    with sessions() as db:
        if outcome.status == JobStatus.QUEUED:
            moved = retries.hand_back(db, job_id=job_id, attempt=attempt,
                                      detail=outcome.detail or "handed back by its worker")
        elif outcome.status == JobStatus.FAILED:
            moved = retries.settle_failure(db, job_id=job_id, attempt=attempt, error=outcome.error or {},
                                           exit_code=outcome.exit_code) is not None
        else:
            # A success after retries keeps the earlier attempts' causes in `error`.
            values = {"summary": outcome.summary} | ({"error": outcome.error} if outcome.error else {})
            moved = jobs.transition(db, job_id=job_id, to=outcome.status, attempt=attempt, values=values,
                                    detail=(outcome.error or {}).get("message"))
            retries.close_attempt(db, job_id=job_id, attempt=attempt, status=outcome.status.value,
                                  error=outcome.error, exit_code=outcome.exit_code)
        db.commit()
    if not moved:
        log.warning("job %s attempt %s: outcome %s not recorded (the job moved on)", job_id, attempt,
                    outcome.status)
