"""The RQ job function: claim the job, run one attempt under a supervisor, record the outcome."""

import json
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.jobs.spec import JobSpec
from service.jobs.status import JobStatus
from service.settings import Settings, get_settings
from worker.launch import SPEC_FILE
from worker.supervisor import Outcome, Supervisor

log = logging.getLogger(__name__)


def worker_name() -> str:
    return os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}:{os.getppid()}"


def run_job(job_id: str) -> dict:
    """Run one attempt of `job_id`; returns what happened (RQ keeps it as the result)."""
    settings = get_settings()
    engine = make_engine(settings.resolved_database_url)
    sessions = make_sessionmaker(engine)
    try:
        claimed = claim(sessions, settings=settings, job_id=job_id)
        if claimed is None:
            return {"job_id": job_id, "skipped": True}
        attempt, spec = claimed
        run_dir = prepare_run_dir(settings, job_id=job_id, attempt=attempt, spec=spec)
        supervisor = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=attempt,
                                spec=spec, run_dir=run_dir)
        try:
            outcome = supervisor.run()
        except Exception as exc:  # a bug or a launch failure: the job must not stay running
            log.exception("supervising job %s failed", job_id)
            outcome = Outcome(JobStatus.FAILED, error={"type": type(exc).__name__, "message": str(exc),
                                                       "rank": None, "where": "supervisor"})
        record(sessions, job_id=job_id, attempt=attempt, outcome=outcome)
        return {"job_id": job_id, "attempt": attempt, "status": outcome.status.value}
    finally:
        engine.dispose()


def claim(sessions, *, settings: Settings, job_id: str) -> tuple[int, JobSpec] | None:
    """queued → starting by compare-and-set, and open the attempt with its lease."""
    with sessions() as db:
        moved = jobs.transition(
            db, job_id=job_id, to=JobStatus.STARTING, detail=f"claimed by {worker_name()}",
            values={"attempt": Job.attempt + 1, "started_at": utcnow()},
            where=[Job.cancel_requested_at.is_(None)],
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


def record(sessions, *, job_id: str, attempt: int, outcome: Outcome) -> None:
    """The final compare-and-set; fenced by attempt so a stale worker cannot overwrite a newer one."""
    with sessions() as db:
        values = {"summary": outcome.summary, "error": outcome.error}
        moved = jobs.transition(db, job_id=job_id, to=outcome.status, attempt=attempt, values=values,
                                detail=(outcome.error or {}).get("message"))
        db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt).values(
            status=outcome.status.value, finished_at=utcnow(), exit_code=outcome.exit_code,
            error=outcome.error, lease_expires_at=None))
        db.commit()
    if not moved:
        log.warning("job %s attempt %s: outcome %s not recorded (the job moved on)", job_id, attempt,
                    outcome.status)
