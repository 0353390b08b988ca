"""What shipping costs the database (issue 42): a ship with nothing new writes nothing and leaves the job's ETag
alone; progress moves it; points written by COPY on PostgreSQL are exactly those an INSERT stores."""

import json
import time

import pytest
from sqlalchemy import event, insert, select, text
from sqlalchemy.exc import DataError

from service.db import UNREACHABLE, is_refusal, make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle, records
from service.jobs import service as jobs
from service.metrics import service as metrics
from service.metrics.models import Metric, MetricBlock
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from worker.shipping import MetricCaps, MetricTail
from worker.supervisor import Supervisor


class Output:
    """The ranks' output as the supervisor's pump gives it: what was put since the last take."""

    def __init__(self) -> None:
        self.data = b""

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


def report(run_dir, *steps: int) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        for step in steps:
            f.write(json.dumps({"type": "metrics", "step": step, "time": time.time(),
                                "metrics": {"loss": 1.0 / step, "step_time_s": 0.25}}) + "\n")


def test_a_ship_with_nothing_new_writes_nothing_and_the_job_s_etag_moves_only_with_its_progress(
        client, settings, tmp_path):
    spec = mlp_spec(train={"max_steps": 100, "log_every": 1})
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=60)
        assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="launched")
        db.commit()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sup = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=attempt,
                     spec=JobSpec.model_validate(spec), run_dir=run_dir)
    sup.shipper.open(max_bytes=1 << 20)
    output = Output()
    report(run_dir, 1, 2)
    output.data = b"step 2\n"
    sup._ship(output)
    job = client.get(f"/v1/jobs/{job_id}")
    assert job.json()["progress"]["step"] == 2
    etag = job.headers["etag"]

    statements = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, sql, *args: statements.append(sql))
    event.listen(engine, "commit", lambda conn: statements.append("COMMIT"))
    for _ in range(3):
        sup._ship(output)
    assert statements == []  # no fence, no UPDATE, no commit: the lease alone says the worker lives
    assert client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag}).status_code == 304

    output.data = b"more output, no step\n"  # output alone: stored, the job's row untouched
    sup._ship(output)
    assert statements and not [sql for sql in statements if sql.lstrip().upper().startswith("UPDATE JOBS")]
    assert client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag}).status_code == 304
    assert client.get(f"/v1/jobs/{job_id}/logs").text == "step 2\nmore output, no step\n"

    report(run_dir, 3)  # progress: the job changed, and its ETag with it
    sup._ship(output)
    moved = client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag})
    assert moved.status_code == 200 and moved.json()["progress"]["step"] == 3 and moved.headers["etag"] != etag
    statements.clear()
    sup._ship(output)
    assert statements == []

    with sessions() as db:  # the same progress again (a restarted supervisor, a retried answer): no write
        stored = jobs.get(db, job_id=job_id).progress
        assert not records.record_progress(db, job_id=job_id, attempt=attempt, progress=dict(stored))
        assert records.record_progress(db, job_id=job_id, attempt=attempt, progress={**stored, "step": 4})
        db.rollback()
    assert client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": moved.headers["etag"]}).status_code == 304
    engine.dispose()


TRICKY = [  # a point of every kind MetricTail stores, sanitizes or keeps out
    {"step": 1, "metrics": {"loss": 0.5, "lr": 1e-300, "big": 2**70, "neg": -0.0, "int": 7}},
    {"step": 2, "metrics": {"loss": float("nan"), "bad\x00name": 2.0, "ünï ☃": 1.5, "x" * 200: 1.0}},
    {"step": 2, "metrics": {"loss": 0.25, "max": 1.7976931348623157e308, "tiny": 5e-324}},  # a step again
    {"step": 3, "metrics": {f"n{i}": float(i) for i in range(12)}},  # past max_names
    *({"step": s, "metrics": {"loss": 1.0 / s, "lr": 0.1}} for s in range(4, 600)),  # blocks, and max_points
]


def test_points_copied_on_postgresql_are_exactly_those_an_insert_stores(db_url, tmp_path, monkeypatch):
    """Each job ships the same file; one through insert_batch as it is (COPY on PostgreSQL), the other through
    the INSERT it replaced: the same rows, times to the microsecond, the same block summaries, the same note."""
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    path = tmp_path / "metrics.jsonl"
    now = time.time()
    with path.open("w") as f:
        for i, record in enumerate(TRICKY):
            f.write(json.dumps({"type": "metrics", "time": now + i * 1e-3 + 1e-6, **record}) + "\n")
    caps = MetricCaps(max_points=1_000, max_names=10, name_max_chars=64, rows_per_ship=300)

    def ship_all() -> tuple[str, MetricTail]:
        with sessions() as db:
            job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
            db.commit()
        tail = MetricTail(path, caps)
        while True:
            with sessions() as db:
                metrics.insert_shipped(db, job_id=job_id, attempt=1, node_rank=1, points=tail.part())
                db.commit()
            tail.committed()
            if not tail.more:
                return job_id, tail

    copied, copied_tail = ship_all()
    inserted_by = []

    def insert_as_before(db, *, job_id, attempt, node_rank, steps, names, name_index, values, micros):
        inserted_by.append(len(steps))
        db.execute(insert(Metric), [{"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "step": step,
                                     "name": names[i], "value": value,
                                     "time": metrics.PG_EPOCH + m * metrics.MICROSECOND}
                                    for step, i, value, m in zip(steps, name_index, values, micros, strict=True)])

    monkeypatch.setattr(metrics, "copy_columns", insert_as_before)
    inserted, inserted_tail = ship_all()
    assert bool(inserted_by) == db_url.startswith("postgresql")  # SQLite inserts either way

    def stored(job_id: str) -> tuple[list, list]:
        with sessions() as db:
            points = db.execute(select(Metric.attempt, Metric.node_rank, Metric.step, Metric.name, Metric.value,
                                       Metric.time).where(Metric.job_id == job_id).order_by(Metric.id)).all()
            summaries = db.execute(select(MetricBlock.node_rank, MetricBlock.name, MetricBlock.block,
                                          MetricBlock.points, MetricBlock.last_step, MetricBlock.last_value,
                                          MetricBlock.min_value, MetricBlock.max_value)
                                   .where(MetricBlock.job_id == job_id).order_by(MetricBlock.name,
                                                                                 MetricBlock.block)).all()
        return [tuple(p) for p in points], [tuple(s) for s in summaries]

    (points, summaries), (points_before, summaries_before) = stored(copied), stored(inserted)
    assert points == points_before and summaries == summaries_before
    assert len(points) == 1_000 and {p[1] for p in points} == {1}
    by_name = {(p[2], p[3]): p[4] for p in points}
    assert by_name[(1, "big")] == float(2**70) and by_name[(1, "neg")] == 0.0
    assert by_name[(2, "max")] == 1.7976931348623157e308 and by_name[(2, "tiny")] == 5e-324
    assert by_name[(2, "bad\ufffdname")] == 2.0 and by_name[(2, "ünï ☃")] == 1.5
    assert copied_tail.note() == inserted_tail.note() and "past the job's cap" in copied_tail.note()
    with sessions() as db:
        assert metrics.read_series(db, job_id=copied, node_rank=1) == \
            metrics.read_series(db, job_id=inserted, node_rank=1)
    engine.dispose()


def test_a_copy_the_database_refuses_or_loses_raises_what_an_insert_did(postgres_url):
    """COPY runs under SQLAlchemy, on the driver's connection: its errors are still SQLAlchemy's, so shipping
    still tells data the database refuses (given up alone) from an outage (retried, never given up)."""
    engine = make_engine(postgres_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
    with sessions() as db, pytest.raises(DataError) as refused:  # a name past the column's 64 characters
        metrics.insert_batch(db, job_id=job_id, attempt=1, rows=[(1, "x" * 65, 1.0, utcnow())])
    assert not isinstance(refused.value, UNREACHABLE)  # shipping gives a refused batch up on its own
    with sessions() as db:
        backend = db.scalar(text("SELECT pg_backend_pid()"))
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
        with pytest.raises(UNREACHABLE) as lost:
            metrics.insert_batch(db, job_id=job_id, attempt=1, rows=[(1, "loss", 1.0, utcnow())])
        assert not is_refusal(lost.value) and lost.value.connection_invalidated
    with sessions() as db:  # the pool gave up the lost connection: the next batch goes through
        assert metrics.insert_batch(db, job_id=job_id, attempt=1, rows=[(1, "loss", 1.0, utcnow())]) == 1
        db.commit()
        assert [s["values"] for s in metrics.read_series(db, job_id=job_id)] == [[1.0]]
    engine.dispose()
