"""What a job reports is bounded: per-ship batches (rows and bytes), per-job caps on points, names and name length,
thinning while a job is far behind; what a cap keeps out is counted and said, never a failure."""

import json
import time

from service.db import make_engine, make_sessionmaker
from service.jobs import service as jobs
from service.metrics import service as metrics
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from worker import shipping
from worker.shipping import MetricCaps, MetricTail


def _line(step: int, **values) -> str:
    return json.dumps({"type": "metrics", "step": step, "time": time.time(), "metrics": values}) + "\n"


def _ship(sessions, tail: MetricTail, job_id: str) -> int:
    with sessions() as db:
        n = metrics.insert_shipped(db, job_id=job_id, attempt=1, points=tail.part())
        db.commit()
    tail.committed()
    return n


def _job(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
    return engine, sessions, job_id


def test_points_names_and_long_names_past_the_caps_are_counted_and_said_not_stored(settings, tmp_path):
    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    long = "x" * 65
    path.write_text("".join(_line(s, loss=1.0 / s, **{long: 1.0}) for s in range(1, 6))
                    + _line(6, loss=0.1, acc=0.5, extra=2.0))
    tail = MetricTail(path, MetricCaps(max_points=5, max_names=2, name_max_chars=64))
    assert _ship(sessions, tail, job_id) == 5  # loss at 1..5 fills the cap; 6's points are past it
    with sessions() as db:
        assert [s["name"] for s in metrics.read_series(db, job_id=job_id)] == ["loss"]
        assert metrics.stored(db, job_id=job_id) == ({"loss"}, 5)
    assert tail.note() == (f"kept 5 of 13 metric points; 2 past the job's cap (TRAINJOBS_METRIC_MAX_POINTS=5); 1 "
                           "under names past the job's 2 (TRAINJOBS_METRIC_MAX_NAMES; the first refused: 'extra'); "
                           f"5 under names longer than 64 characters (the first: '{long}')")
    # A later attempt starts from what the job stored: the cap is the job's, not the attempt's.
    again = MetricTail(path, MetricCaps(max_points=5, max_names=2), known_names={"loss"}, points=5)
    again.pos = path.stat().st_size
    with open(path, "a") as f:
        f.write(_line(7, loss=0.05))
    assert _ship(sessions, again, job_id) == 0 and again.counts.over_points == 1
    engine.dispose()


def test_a_ship_stores_at_most_its_batch_and_leaves_the_rest_for_the_next(settings, tmp_path):
    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s, a=1.0, b=2.0) for s in range(1, 251)) + '{"type": "summary", "time": 1.0, '
                    '"summary": {"done": true}}\n')
    tail = MetricTail(path, MetricCaps(rows_per_ship=100))
    shipped = []
    while True:
        shipped.append(_ship(sessions, tail, job_id))
        if not tail.more:
            break
    assert shipped == [100] * 5  # 50 records of two points each per ship, in order
    assert tail.summary == {"done": True} and tail.last_step == 250 and tail.note() is None
    with sessions() as db:
        assert metrics.read_series(db, job_id=job_id, name="a")[0]["steps"] == list(range(1, 251))
    engine.dispose()


def test_far_behind_the_steps_are_thinned_and_counted(settings, tmp_path, monkeypatch):
    monkeypatch.setattr(shipping, "READ_MAX", 4096)
    monkeypatch.setattr(shipping, "THIN_BACKLOG", 16384)
    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s, loss=float(s)) for s in range(1, 2001)))
    tail = MetricTail(path)
    stored = 0
    while True:
        stored += _ship(sessions, tail, job_id)
        if not tail.more:
            break
    assert tail.counts.thinned > 0 and stored + tail.counts.thinned == 2000  # every point is kept or counted
    assert tail.last_step == 2000  # progress still follows every step
    assert "thinned while the job reported faster than the service ships" in tail.note()
    with sessions() as db:
        steps = metrics.read_series(db, job_id=job_id)[0]["steps"]
    assert len(steps) == stored and steps[-1] == 2000  # the newest steps, unthinned once it caught up
    engine.dispose()


def test_a_line_longer_than_a_read_is_skipped_whole_and_the_lines_after_it_are_read(settings, tmp_path, monkeypatch):
    monkeypatch.setattr(shipping, "READ_MAX", 4096)
    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    path.write_text(_line(1, loss=1.0) + "x" * 10_000 + "\n" + _line(2, loss=0.5))
    tail = MetricTail(path)
    while True:
        _ship(sessions, tail, job_id)
        if not tail.more:
            break
    with sessions() as db:
        assert metrics.read_series(db, job_id=job_id) == [{"name": "loss", "steps": [1, 2], "values": [1.0, 0.5]}]
    assert tail.counts.long_lines == 1 and "1 line(s) of the metrics file longer than 4096 bytes skipped" in tail.note()
    engine.dispose()


def test_eight_thousand_names_at_one_step_are_written_in_bounded_statements(settings, tmp_path):
    """~8,000 (name, block) pairs in one IN list once failed on PostgreSQL (stack depth limit exceeded)."""
    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    path.write_text(_line(1, **{f"m{i}": float(i) for i in range(8000)}))
    tail = MetricTail(path, MetricCaps(max_names=10_000))
    assert _ship(sessions, tail, job_id) == 8000
    with open(path, "a") as f:  # the same names again: every block exists, and is read back in chunks
        f.write(_line(2, **{f"m{i}": float(i) for i in range(8000)}))
    assert _ship(sessions, tail, job_id) == 8000
    with sessions() as db:
        assert metrics.stored(db, job_id=job_id) == ({f"m{i}" for i in range(8000)}, 16000)
    engine.dispose()


def test_a_running_job_s_performance_is_the_newest_of_its_throughput_series(settings, tmp_path):
    from worker.attempt.ship import progress

    engine, sessions, job_id = _job(settings)
    path = tmp_path / "metrics.jsonl"
    path.write_text(_line(10, loss=1.0, samples_per_s=900.0, step_time_s=0.02)
                    + _line(20, loss=0.5, samples_per_s=1000.0, step_time_s=0.018, mfu=0.4))
    tail = MetricTail(path, MetricCaps(max_points=100, max_names=10, name_max_chars=64))
    _ship(sessions, tail, job_id)
    spec = JobSpec.model_validate(mlp_spec(train={"max_steps": 100}))
    assert progress(spec, tail)["performance"] == {"samples_per_s": 1000.0, "step_time_s": 0.018, "mfu": 0.4}
    engine.dispose()
