"""Alembic's migrations build exactly the schema the models describe, on both databases."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, insert, text
from sqlalchemy.orm import Session

from service import migrate
from service.db import utcnow
from service.metrics.models import Metric
from service.models import Base
from tests.helpers import insert_old_job


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrations_match_the_models(request, backend):
    url = request.getfixturevalue(f"{backend}_url")
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_is_idempotent(sqlite_url):
    migrate.upgrade(sqlite_url)  # already at head: nothing to do, nothing fails


def add_metric(db: Session, job_id: str, metric_id: int | None = None) -> int:
    values = {"job_id": job_id, "attempt": 1, "step": 1, "name": "loss", "value": 0.5, "time": utcnow()}
    if metric_id is not None:
        values["id"] = metric_id
    return db.execute(insert(Metric.__table__).values(**values).returning(Metric.__table__.c.id)).scalar_one()


def test_metric_ids_go_past_2_to_the_31(db_url):
    engine = create_engine(db_url)
    with Session(engine) as db:
        job_id = insert_old_job(db)
        assert add_metric(db, job_id, 2**31 + 5) == 2**31 + 5
        if db.bind.dialect.name == "postgresql":  # a serial's next value is its sequence's, not the largest id's
            db.execute(text("SELECT setval('metrics_id_seq', :at)"), {"at": 2**31 + 5})
        assert add_metric(db, job_id) == 2**31 + 6  # shipping goes on past 2^31 points
        db.rollback()
    engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0008_widens_metric_ids_and_its_downgrade_narrows_them_keeping_the_points(request, tmp_path, backend):
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("fresh_postgres")
    migrate.upgrade(url, "0007")
    engine = create_engine(url)
    with Session(engine) as db:  # 0008 changes only metrics: the jobs table is the models' already
        job_id = insert_old_job(db)
        kept = add_metric(db, job_id)
        db.commit()
    migrate.upgrade(url)
    with Session(engine) as db:
        big = add_metric(db, job_id, 2**40)
        if backend == "postgres":
            db.execute(text("SELECT setval('metrics_id_seq', :at)"), {"at": big})
        assert add_metric(db, job_id) == big + 1  # autoincrement still works (SQLite: the rowid)
        db.execute(text("DELETE FROM metrics WHERE id > :kept"), {"kept": kept})
        db.commit()
    migrate.downgrade(url, "0007")
    migrate.upgrade(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM metrics")).scalars().all() == [kept]
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []
