"""Jobs per status and priority kept as jobs change (service/jobs/counts.py): always what a count would say."""

import threading
from collections import Counter

import pytest
from sqlalchemy import create_engine, delete, func, select, text, update
from sqlalchemy.orm import Session

from service import migrate
from service.jobs import counts, lifecycle
from service.jobs import service as jobs
from service.jobs.models import Job, JobCountDelta
from tests.conftest import _empty_tables, mlp_spec
from tests.helpers import insert_old_job
from trainjobs.spec import JobSpec


def counted(db: Session) -> dict[tuple[str, str], int]:
    """What a count over every job says (what the kept counts replace)."""
    return dict(Counter((r.status, r.priority) for r in db.execute(select(Job.status, Job.priority))))


def kept(db: Session) -> dict[tuple[str, str], int]:
    return {key: n for key, n in counts.by_status_and_priority(db).items() if n}


def add(db: Session, **overrides) -> str:
    job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(**overrides)))
    db.commit()
    return job.id


def test_kept_counts_follow_every_insert_move_and_delete_before_and_after_compaction(db_url):
    engine = create_engine(db_url)
    with Session(engine) as db:
        ids = [add(db) for _ in range(4)] + [add(db, priority="high")]
        assert kept(db) == counted(db) == {("queued", "normal"): 4, ("queued", "high"): 1}
        lifecycle.claim(db, job_id=ids[0], worker="w0", lease_s=30)
        db.commit()
        lifecycle.request_cancel(db, job_id=ids[1])
        db.execute(update(Job).where(Job.id == ids[2]).values(priority="high"))  # aging
        db.execute(update(Job).where(Job.id == ids[3]).values(name="renamed"))  # no move: no delta
        db.commit()
        assert kept(db) == counted(db)
        counts.compact(db)
        db.commit()
        assert db.scalar(select(func.count()).select_from(JobCountDelta)) == 0
        assert kept(db) == counted(db) == {("starting", "normal"): 1, ("cancelled", "normal"): 1,
                                           ("queued", "high"): 2, ("queued", "normal"): 1}
        db.execute(delete(Job).where(Job.id.in_(ids[:2])))  # retention deletes finished jobs
        db.commit()
        assert kept(db) == counted(db)
        db.execute(update(Job).where(Job.id == ids[3]).values(status="failed"))
        db.rollback()  # a move rolled back leaves no delta
        counts.compact(db)
        db.commit()
        assert kept(db) == counted(db)
    engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0012_counts_the_jobs_already_stored(request, tmp_path, backend):
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("fresh_postgres")
    migrate.upgrade(url, "0011")
    engine = create_engine(url)
    with Session(engine) as db:
        for priority in ("normal", "normal", "low"):
            insert_old_job(db, priority=priority)  # the columns of revision 0011: not the models' newest
        db.execute(text("UPDATE jobs SET status = 'succeeded' WHERE priority = 'low'"))
        db.commit()
    migrate.upgrade(url)
    with Session(engine) as db:
        assert kept(db) == counted(db) == {("queued", "normal"): 2, ("succeeded", "low"): 1}
    migrate.downgrade(url, "0011")
    migrate.upgrade(url)
    engine.dispose()


def test_counts_stay_exact_with_writers_and_compactions_at_once(postgres_url):
    _empty_tables(postgres_url)
    engine = create_engine(postgres_url, pool_size=8)
    stop = threading.Event()

    def write(n: int) -> None:
        with Session(engine) as db:
            for i in range(n):
                job_id = add(db, priority=("low", "normal", "high")[i % 3])
                if i % 2:
                    lifecycle.request_cancel(db, job_id=job_id)

    def compact() -> None:
        with Session(engine) as db:
            while not stop.is_set():
                counts.compact(db)
                db.commit()

    compactors = [threading.Thread(target=compact) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(30,)) for _ in range(4)]
    for t in compactors + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in compactors:
        t.join()
    with Session(engine) as db:
        assert kept(db) == counted(db) and sum(counted(db).values()) == 120
    engine.dispose()


def test_a_bloated_deltas_table_is_emptied_by_the_next_compaction_and_the_counts_stay_exact(postgres_url):
    _empty_tables(postgres_url)
    engine = create_engine(postgres_url)
    with Session(engine) as db:
        job_id = add(db)
        # a burst: many moves (a job aged back and forth), as a bulk load's inserts leave them
        for i in range(12_000):
            db.execute(update(Job).where(Job.id == job_id).values(priority=("high", "normal")[i % 2]))
        db.commit()
        assert db.scalar(text("SELECT pg_relation_size('job_count_deltas')")) > counts.BLOATED_BYTES
        counts.compact(db)
        db.commit()
        assert db.scalar(text("SELECT pg_relation_size('job_count_deltas')")) == 0
        assert kept(db) == counted(db) == {("queued", "normal"): 1}
    engine.dispose()
