"""Retention: the bulky rows and files of jobs finished long ago, deleted in short batches (`trainjobs gc`, and
the sweeper hourly when TRAINJOBS_RETENTION_DAYS is set).

What goes: log chunks, metric points, events, and the job's storage folder (checkpoints, artifacts). What
stays: the job's row (spec, status, summary, error) and its metrics' per-256-step block summaries, so an old
job still reads and its chart still draws (service/metrics/service.py, from the summaries). Only a job in a
terminal state that finished before the cutoff is touched: a live one never is. Each batch is its own short
transaction; a folder is removed after its batch commits (a failed removal is retried by the next run).
"""

import itertools
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.jobs.models import Job, JobEvent
from service.logs.models import LogChunk
from service.metrics.models import Metric
from trainjobs.paths import job_dir
from trainjobs.states import TERMINAL

BATCH = 200  # jobs per transaction
TABLES = (("log_chunks", LogChunk), ("metric_points", Metric), ("events", JobEvent))


@dataclass
class Collected:
    """What a run deleted (or, dry, would delete)."""

    jobs: int = 0  # jobs that had anything to delete
    log_chunks: int = 0
    metric_points: int = 0
    events: int = 0
    folders: int = 0
    resume_after: str | None = None  # where a run cut short by max_batches goes on; None once it went through

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "resume_after"}


def collect(db: Session, *, cutoff: datetime, storage_dir: Path, dry_run: bool = False, batch: int = BATCH,
            after: str = "", max_batches: int | None = None) -> Collected:
    """Delete the rows and folders of the jobs that finished before cutoff (of ids past `after`); dry_run
    counts them only. With max_batches, stops after that many and says where to go on (resume_after)."""
    done = Collected()
    for _ in range(max_batches) if max_batches is not None else itertools.count():
        ids = list(db.scalars(select(Job.id).where(Job.status.in_(list(TERMINAL)), Job.finished_at < cutoff,
                                                   Job.id > after).order_by(Job.id).limit(batch)))
        if not ids:
            done.resume_after = None
            return done
        after = done.resume_after = ids[-1]
        touched: set[str] = set()
        for field, table in TABLES:
            rows = db.execute(select(table.job_id, func.count()).where(table.job_id.in_(ids))
                              .group_by(table.job_id)).all()
            touched.update(job_id for job_id, _ in rows)
            setattr(done, field, getattr(done, field) + sum(n for _, n in rows))
            if rows and not dry_run:
                db.execute(delete(table).where(table.job_id.in_([job_id for job_id, _ in rows])))
        folders = [job_dir(storage_dir, job_id) for job_id in ids if job_dir(storage_dir, job_id).exists()]
        touched.update(folder.name for folder in folders)
        done.folders += len(folders)
        done.jobs += len(touched)
        if dry_run:
            db.rollback()
            continue
        db.commit()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    return done  # cut short: resume_after says where the next run goes on
