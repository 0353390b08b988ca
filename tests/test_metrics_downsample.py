"""max_points on GET /v1/jobs/{id}/metrics: a long series thinned for a chart, its shape kept."""

import math
import random

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.db import utcnow
from service.metrics import service as metrics
from service.metrics.downsample import downsample
from tests.conftest import mlp_spec


def store(db_url: str, job_id: str, rows: list[tuple[int, str, float]], attempt: int = 1) -> None:
    engine = create_engine(db_url)
    with Session(engine) as db:
        metrics.insert_batch(db, job_id=job_id, attempt=attempt, rows=[(s, n, v, utcnow()) for s, n, v in rows])
        db.commit()
    engine.dispose()


def test_a_10k_point_series_thinned_to_500_keeps_min_max_and_last_point(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    rng = random.Random(0)
    values = [math.sin(i / 300) + rng.gauss(0, 0.1) for i in range(10_000)]
    values[1234], values[8765] = -50.0, 70.0  # spikes a plain stride would miss
    store(settings.database_url, job["id"], [(i, "loss", v) for i, v in enumerate(values)])
    r = client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 500})
    assert r.status_code == 200
    (series,) = r.json()["series"]
    steps, got = series["steps"], series["values"]
    assert len(steps) <= 500 and len(steps) == len(got)
    assert all(a < b for a, b in zip(steps, steps[1:], strict=False))
    assert min(got) == -50.0 and max(got) == 70.0
    assert steps[-1] == 9999 and got[-1] == values[-1]
    full = client.get(f"/v1/jobs/{job['id']}/metrics").json()["series"][0]
    assert len(full["steps"]) == 10_000


def test_max_points_keeps_the_latest_attempts_value_per_step_and_honours_after_step(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    store(settings.database_url, job["id"], [(i, "loss", 1.0) for i in range(100)])
    store(settings.database_url, job["id"], [(i, "loss", 2.0) for i in range(50, 100)], attempt=2)
    params = {"max_points": 10, "after_step": 49}
    (series,) = client.get(f"/v1/jobs/{job['id']}/metrics", params=params).json()["series"]
    assert set(series["values"]) == {2.0} and series["steps"][0] >= 50 and series["steps"][-1] == 99


def test_max_points_out_of_range_is_422(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    for bad in (0, 100_001):
        assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": bad}).status_code == 422


def test_downsample_edge_cases():
    steps, values = list(range(10)), [float(v) for v in (5, 1, 9, 3, 3, 3, 0, 3, 3, 4)]
    assert downsample(steps, values, 10) == (steps, values)
    assert downsample(steps, values, 1) == ([9], [4.0])
    assert downsample(steps, values, 2) == ([2, 9], [9.0, 4.0])  # the point farthest from the last
    s, v = downsample(steps, values, 3)
    assert s == [2, 6, 9] and v == [9.0, 0.0, 4.0]
    for k in range(1, 12):
        s, _ = downsample(steps, values, k)
        assert len(s) <= k and s == sorted(set(s)) and s[-1] == 9
