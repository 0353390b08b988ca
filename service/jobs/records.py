"""What a running attempt records about its job besides its state: progress, resume step, stacks, warnings.

None of these is a state change (those are service/jobs/lifecycle.py's): each writes a side field of the job or
of one attempt, fenced by the attempt where it matters. The worker calls them inside its shipping transaction
(fenced by lifecycle.still_held); the API asks for stacks through request_stacks.
"""

import json
from datetime import datetime

from sqlalchemy import func, literal, select, text, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Attempt, Job
from service.jobs.service import record_event
from trainjobs.states import JobStatus

WARNINGS_KEPT = 50


def record_phase(db: Session, *, job_id: str, attempt: int, phase: str) -> None:
    """What a starting attempt is doing before its ranks run (installing requirements, launching), shown as the
    job's pending_reason while it is `starting`. Written only while this attempt holds the job and it starts."""
    db.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt, Job.status == JobStatus.STARTING)
               .values(pending_reason=phase[:500]))


def record_stacks(db: Session, *, job_id: str, attempt: int, node_rank: int, stacks: dict) -> None:
    """The ranks' stacks (a hang's, or asked for) on this node's attempt; a hang is an event of the job too."""
    db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                     Attempt.node_rank == node_rank).values(stacks=stacks))
    if stacks.get("reason") == "hang":
        record_event(db, job_id=job_id, kind="hung", detail=stacks.get("message"))


def add_warning(db: Session, *, job_id: str, warning: dict) -> None:
    """Something a user should know about a job that still runs (a straggler), kept on the job and as an event.

    The job's row is locked to read the list (the nodes of a gang add theirs), at the end of a shipping transaction.
    """
    warnings = db.execute(select(Job.warnings).where(Job.id == job_id).with_for_update()).scalar_one_or_none() or []
    stamped = {**warning, "time": utcnow().isoformat()}
    db.execute(update(Job).where(Job.id == job_id).values(warnings=[*warnings, stamped][-WARNINGS_KEPT:]))
    record_event(db, job_id=job_id, kind=warning["kind"], detail=warning["message"])


def set_warning(db: Session, *, job_id: str, warning: dict) -> None:
    """A warning that is updated as the job runs (what the metric caps kept out): it replaces the one of the same
    kind, attempt and node, and is an event only the first time."""
    key = (warning["kind"], warning.get("attempt"), warning.get("node_rank"))
    warnings = db.execute(select(Job.warnings).where(Job.id == job_id).with_for_update()).scalar_one_or_none() or []
    kept = [w for w in warnings if (w.get("kind"), w.get("attempt"), w.get("node_rank")) != key]
    stamped = {**warning, "time": utcnow().isoformat()}
    db.execute(update(Job).where(Job.id == job_id).values(warnings=[*kept, stamped][-WARNINGS_KEPT:]))
    if len(kept) == len(warnings):
        record_event(db, job_id=job_id, kind=warning["kind"], detail=warning["message"])


def request_stacks(db: Session, *, job_id: str) -> datetime | None:
    """Ask the running job's supervisors for every rank's stack; the request's time, None unless it runs."""
    asked = utcnow()
    done = db.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.RUNNING)
                      .values(stacks_requested_at=asked)).rowcount
    db.commit()
    return asked if done else None


def record_progress(db: Session, *, job_id: str, attempt: int, progress: dict) -> bool:
    """The attempt's progress, written only when it differs from the stored one: the job's row, and with it its
    version (its ETag), moves only when the job does, whichever side calls (a supervisor that restarted, a retry
    of a lost answer). False when nothing was written."""
    if db.get_bind().dialect.name == "postgresql":  # json has no equality; jsonb compares values
        changed = Job.progress.cast(JSONB).is_distinct_from(literal(progress, JSONB))
    else:  # SQLite: both as json() minifies them (written by the same json.dumps)
        changed = func.json(Job.progress).is_distinct_from(func.json(json.dumps(progress)))
    return db.execute(update(Job).where(Job.id == job_id, Job.attempt == attempt, changed)
                      .values(progress=progress)).rowcount == 1


# record_progress of several jobs in one statement (PostgreSQL): each row written only where its progress differs.
PG_PROGRESS_MANY = text("""UPDATE jobs SET progress = CAST(v.progress AS json)
FROM unnest(CAST(:job_ids AS text[]), CAST(:attempts AS int[]), CAST(:progress AS text[]))
AS v(job_id, attempt, progress)
WHERE jobs.id = v.job_id AND jobs.attempt = v.attempt
AND CAST(jobs.progress AS jsonb) IS DISTINCT FROM CAST(v.progress AS jsonb)""")


def record_progress_many(db: Session, progress: list[tuple[str, int, dict]]) -> None:
    """record_progress of several (job_id, attempt, progress), in their order (a job's last one is what it keeps):
    on PostgreSQL one UPDATE, written as record_progress writes it (the same json.dumps text) and only where it
    differs."""
    if db.get_bind().dialect.name != "postgresql":
        for job_id, attempt, value in progress:
            record_progress(db, job_id=job_id, attempt=attempt, progress=value)
        return
    last = {(job_id, attempt): value for job_id, attempt, value in progress}  # one row a job, as in turn
    if last:
        db.execute(PG_PROGRESS_MANY, {"job_ids": [job_id for job_id, _ in last], "attempts": [a for _, a in last],
                                      "progress": [json.dumps(value) for value in last.values()]})


def record_resume(db: Session, *, job_id: str, attempt: int, node_rank: int, step: int) -> None:
    """The attempt's ranks loaded the checkpoint of `step`."""
    db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt,
                                     Attempt.node_rank == node_rank).values(resumed_from_step=step))
