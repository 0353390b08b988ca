"""Retention: the bulky rows and files of jobs finished long ago, deleted in short batches (`trainjobs gc`, and
the sweeper hourly when TRAINJOBS_RETENTION_DAYS is set).

What goes: log chunks, metric points, events, the job's storage folder (checkpoints, artifacts) and, where a store
is set (TRAINJOBS_STORAGE_URL), every object under the job's prefix in it (checkpoints, their parts and manifests,
artifacts; packages stay: they are shared by digest and go with their last owner's copy). What stays: the job's
row (spec, status, summary, error) and its metrics' per-256-step block summaries, so an old job still reads and
its chart still draws (service/metrics/service.py, from the summaries). Only a job in a terminal state that
finished before the cutoff is touched: a live one never is. Each batch is its own short transaction; a folder and
the store's objects are removed after its batch commits, and then the job is marked collected (`collected_at`):
later runs look only at old jobs not yet marked, so a million collected jobs cost a run nothing. A failed removal
leaves the job unmarked and the next run tries again (a store out of reach delays its objects' deletion, never
the rows').
"""

import itertools
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Job, JobEvent
from service.logs.models import LogChunk
from service.metrics.models import Metric
from service.storage import Store, StoreUnavailable, job_prefix
from trainjobs.paths import job_dir
from trainjobs.states import TERMINAL

log = logging.getLogger(__name__)
BATCH = 200  # jobs per transaction
LISTERS = 8  # the store's listings of a batch's prefixes at once
TABLES = (("log_chunks", LogChunk), ("metric_points", Metric), ("events", JobEvent))


@dataclass
class Collected:
    """What a run deleted (or, dry, would delete)."""

    jobs: int = 0  # jobs that had anything to delete
    log_chunks: int = 0
    metric_points: int = 0
    events: int = 0
    folders: int = 0
    store_objects: int = 0  # objects deleted from the store (TRAINJOBS_STORAGE_URL) under the jobs' prefixes
    resume_after: str | None = None  # where a run cut short by max_batches goes on; None once it went through

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "resume_after"}


def collect(db: Session, *, cutoff: datetime, storage_dir: Path, store: Store | None = None, dry_run: bool = False,
            batch: int = BATCH, after: str = "", max_batches: int | None = None) -> Collected:
    """Delete the rows, folders and stored objects (`store`: the configured one, or None) of the jobs that finished
    before cutoff (of ids past `after`); dry_run counts them only. With max_batches, stops after that many and
    says where to go on (resume_after)."""
    done, with_store = Collected(), store is not None
    for _ in range(max_batches) if max_batches is not None else itertools.count():
        ids = list(db.scalars(select(Job.id).where(Job.collected_at.is_(None), Job.finished_at.is_not(None),
                                                   Job.status.in_(list(TERMINAL)), Job.finished_at < cutoff,
                                                   Job.id > after).order_by(Job.id).limit(batch)))
        if not ids:
            done.resume_after = None
            return done
        after = done.resume_after = ids[-1]
        stored, store = stored_keys(store, ids)  # listed before the deletes: no row is locked while the store answers
        touched: set[str] = set(stored)
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
            done.store_objects += sum(map(len, stored.values()))
            continue
        db.commit()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        deleted, store = delete_stored(store, stored)
        done.store_objects += deleted
        if store is not None or not with_store:  # the store answered every listing and delete of this run
            mark_collected(db, [job_id for job_id in ids if not job_dir(storage_dir, job_id).exists()])
    return done  # cut short: resume_after says where the next run goes on


def mark_collected(db: Session, ids: list[str]) -> None:
    """These jobs hold nothing retention deletes any more: later runs skip them (a job whose folder or stored
    objects could not go stays unmarked, so the next run tries again)."""
    if ids:
        db.execute(update(Job).where(Job.id.in_(ids)).values(collected_at=utcnow()))
        db.commit()


def stored_keys(store: Store | None, ids: list[str]) -> tuple[dict[str, list[str]], Store | None]:
    """Each job's objects in the store, and the store to ask next: None once it failed to answer (the rest of
    the run leaves the store alone rather than wait out its timeout job by job)."""
    if store is None:
        return {}, None
    # A listing a job, LISTERS at a time (only jobs not yet marked collected: each is listed until it is).
    pool = ThreadPoolExecutor(LISTERS)
    try:
        listed = list(pool.map(lambda job_id: [o.key for o in store.list(job_prefix(job_id))], ids))
    except StoreUnavailable as exc:
        log.warning("retention: the store's objects wait for the next run: %s", exc.message)
        return {}, None
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure: the listings not yet begun are not
    return {job_id: keys for job_id, keys in zip(ids, listed, strict=True) if keys}, store


def delete_stored(store: Store | None, stored: dict[str, list[str]]) -> tuple[int, Store | None]:
    """Delete the listed objects: how many, and the store to ask next (None once it failed)."""
    keys = [key for job_keys in stored.values() for key in job_keys]
    if store is None or not keys:
        return 0, store
    try:
        store.delete(keys)
    except StoreUnavailable as exc:
        log.warning("retention: the store's objects wait for the next run: %s", exc.message)
        return 0, None
    return len(keys), store
