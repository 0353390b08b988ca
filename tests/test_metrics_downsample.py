"""max_points on GET /v1/jobs/{id}/metrics: a long series thinned for a chart, its shape kept."""

import math
import random

from sqlalchemy import create_engine, insert, select
from sqlalchemy.orm import Session

from service import migrate
from service.db import utcnow
from service.metrics import blocks
from service.metrics import service as metrics
from service.metrics.downsample import downsample
from service.metrics.models import Metric, MetricBlock
from tests.conftest import mlp_spec
from tests.helpers import insert_old_job


def store(db_url: str, job_id: str, rows: list[tuple[int, str, float]], attempt: int = 1, node_rank: int = 0) -> None:
    engine = create_engine(db_url)
    with Session(engine) as db:
        metrics.insert_batch(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                             rows=[(s, n, v, utcnow()) for s, n, v in rows])
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


def blocks_of(db_url: str, job_id: str, name: str = "loss", node_rank: int = 0) -> list[tuple]:
    engine = create_engine(db_url)
    with Session(engine) as db:
        rows = db.execute(select(MetricBlock.block, MetricBlock.points, MetricBlock.last_step, MetricBlock.last_value,
                                 MetricBlock.min_step, MetricBlock.min_value, MetricBlock.max_step,
                                 MetricBlock.max_value).where(MetricBlock.job_id == job_id, MetricBlock.name == name,
                                                              MetricBlock.node_rank == node_rank)
                          .order_by(MetricBlock.block)).all()
        recomputed = [(b.block, *vars(blocks.summarize(blocks.block_points(
            db, job_id=job_id, node_rank=node_rank, name=name, block=b.block))).values()) for b in rows]
    engine.dispose()
    assert [tuple(r) for r in rows] == recomputed  # every summary is exactly its points' (latest attempt's)
    return rows


def test_a_long_series_is_thinned_from_its_block_summaries_keeping_min_max_and_last(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    values = [math.cos(i / 200) for i in range(5000)]
    values[777], values[4321] = -9.0, 9.0
    # shipped in uneven batches, as a supervisor does: blocks are merged across batches
    for lo, hi in ((0, 5), (5, 1000), (1000, 1001), (1001, 5000)):
        store(settings.database_url, job["id"], [(i, "loss", values[i]) for i in range(lo, hi)])
    summaries = blocks_of(settings.database_url, job["id"])
    assert len(summaries) == math.ceil(5000 / blocks.BLOCK_STEPS)
    (series,) = client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 21}).json()["series"]
    steps, got = series["steps"], series["values"]
    assert (steps, got) == blocks.thin(summaries, 21)  # the database's bucketing is thin()'s, exactly
    assert len(steps) <= 21 and all(a < b for a, b in zip(steps, steps[1:], strict=False))
    assert min(got) == -9.0 and max(got) == 9.0 and steps[-1] == 4999 and got[-1] == values[4999]
    assert all(values[s] == v for s, v in zip(steps, got, strict=True))  # real points, not averages
    params = {"max_points": 21, "after_step": 1000}  # cuts a block: its part after the step comes from points
    (cut,) = client.get(f"/v1/jobs/{job['id']}/metrics", params=params).json()["series"]
    assert cut["steps"][0] > 1000 and min(cut["values"]) == min(values[1001:]) and cut["steps"][-1] == 4999


def test_a_retry_that_rewrites_steps_recomputes_their_blocks(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    first = [0.0] * 3000
    first[2500] = 99.0  # attempt 1's spike, at a step that attempt 2 runs again
    store(settings.database_url, job["id"], [(i, "loss", first[i]) for i in range(3000)])
    store(settings.database_url, job["id"], [(i, "loss", 1.0) for i in range(2400, 3000)]
          + [(i, "acc", i / 3000) for i in range(3000)], attempt=2)
    blocks_of(settings.database_url, job["id"])
    blocks_of(settings.database_url, job["id"], name="acc")
    acc, loss = client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 11}).json()["series"]
    assert max(loss["values"]) == 1.0 and loss["steps"][-1] == 2999 and loss["values"][-1] == 1.0
    assert 99.0 not in loss["values"]
    assert acc["name"] == "acc" and acc["values"][0] == 0.0 and acc["values"][-1] == 2999 / 3000  # its own buckets


def test_the_migration_backfills_the_summaries_of_points_already_stored(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0005")
    engine = create_engine(url)
    with Session(engine) as db:
        job_id = insert_old_job(db)
        db.commit()
        rows = [{"job_id": job_id, "attempt": a, "step": s, "name": "loss", "value": float(s * a), "time": utcnow()}
                for a, steps in ((1, range(300)), (2, range(200, 300))) for s in steps]
        db.execute(insert(Metric), rows)  # as a worker before this revision wrote them: no summaries
        db.commit()
    engine.dispose()
    migrate.upgrade(url)
    got = blocks_of(url, job_id)
    assert [(b.block, b.points, b.max_step, b.max_value) for b in got] == [(0, 256, 255, 510.0),
                                                                           (1, 44, 299, 598.0)]


def test_a_gang_keeps_a_series_per_node_and_node_0s_is_the_job_s(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    for node, memory in ((0, 100.0), (1, 250.0)):  # the loss is all-reduced, the same on both; memory is not
        store(settings.database_url, job["id"], [(i, "loss", 1 / (i + 1)) for i in range(1000)]
              + [(i, "peak_mem_mb", memory + (i == 500) * node) for i in range(1000)], node_rank=node)
    url = f"/v1/jobs/{job['id']}/metrics"
    default = client.get(url, params={"name": "peak_mem_mb"}).json()
    assert default["node_rank"] == 0 and default["series"][0]["values"] == [100.0] * 1000  # node 1's not mixed in
    node1 = client.get(url, params={"name": "peak_mem_mb", "node_rank": 1}).json()
    assert node1["node_rank"] == 1 and node1["series"][0]["steps"] == list(range(1000))
    assert set(node1["series"][0]["values"]) == {250.0, 251.0}
    thinned = client.get(url, params={"name": "peak_mem_mb", "node_rank": 1, "max_points": 21}).json()["series"]
    assert max(thinned[0]["values"]) == 251.0 and len(thinned[0]["steps"]) <= 21  # from node 1's own blocks
    assert blocks_of(settings.database_url, job["id"], "peak_mem_mb", node_rank=1)[1].max_value == 251.0
    nowhere = client.get(url, params={"node_rank": 5}).json()
    assert (nowhere["node_rank"], nowhere["series"]) == (5, [])  # a node that reported nothing
    bad = client.get(url, params={"node_rank": 1024})
    assert bad.status_code == 422 and "node_rank" in bad.text


def test_the_per_node_migration_makes_stored_points_node_0s_and_rebuilds_their_summaries(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0006")
    engine = create_engine(url)
    with Session(engine) as db:
        job_id = insert_old_job(db)
        db.commit()
        rows = [{"job_id": job_id, "attempt": 1, "step": s, "name": "loss", "value": float(s % 7), "time": utcnow()}
                for s in range(600)]
        db.execute(insert(Metric), rows)  # as a worker at 0006 wrote them: one series, no node
        db.commit()
    engine.dispose()
    migrate.upgrade(url)
    got = blocks_of(url, job_id)  # node 0's, each exactly its points' summary
    assert [(b.block, b.points, b.last_step) for b in got] == [(0, 256, 255), (1, 256, 511), (2, 88, 599)]
    migrate.downgrade(url, "0006")  # and back: the summaries are rebuilt without the node
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM metric_blocks").scalar() == 3
        assert "node_rank" not in {c[1] for c in conn.exec_driver_sql("PRAGMA table_info(metrics)")}
    engine.dispose()
    migrate.upgrade(url)
    assert len(blocks_of(url, job_id)) == 3


def test_a_polled_chart_is_rendered_once_until_its_series_gain_a_point(client, settings, monkeypatch):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    store(settings.database_url, job["id"], [(s, "loss", 1.0 / (s + 1)) for s in range(200)])
    store(settings.database_url, job["id"], [(s, "loss", 2.0) for s in range(3)], node_rank=1)
    reads = []
    thinned = metrics.read_thinned
    monkeypatch.setattr(metrics, "read_thinned", lambda *a, **kw: reads.append(kw) or thinned(*a, **kw))
    path, params = f"/v1/jobs/{job['id']}/metrics", {"max_points": 500}
    first = client.get(path, params=params)
    assert [client.get(path, params=params).content for _ in range(3)] == [first.content] * 3
    assert len(reads) == 1  # the polls that found nothing new rendered nothing
    assert len(client.get(path, params={"max_points": 50}).json()["series"][0]["steps"]) <= 50  # its own chart
    node_1 = client.get(path, params={**params, "node_rank": 1}).json()
    assert node_1["node_rank"] == 1 and node_1["series"][0]["values"] == [2.0, 2.0, 2.0]

    store(settings.database_url, job["id"], [(200, "loss", 0.001)])
    after = client.get(path, params=params).json()
    assert after["series"][0]["steps"][-1] == 200 and after["series"][0]["values"][-1] == 0.001
    assert after["cursor"] > first.json()["cursor"]
    store(settings.database_url, job["id"], [(3, "loss", 9.0)], node_rank=1)  # node 1's chart changes alone
    assert client.get(path, params={**params, "node_rank": 1}).json()["series"][0]["values"][-1] == 9.0
    assert client.get(path, params=params).json() == after
