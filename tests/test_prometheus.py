"""GET /metrics: Prometheus text that a scraper parses, with values read from the database and Redis."""

from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update
from sqlalchemy.orm import Session

from service.db import make_engine, utcnow
from service.jobs import lifecycle
from service.jobs.models import Job
from service.metrics import service as metrics
from service.workers import service as workers
from service.workers.models import Worker
from tests.conftest import admin_token, mlp_spec
from trainjobs.states import JobStatus


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_jobs_by_status_queue_depth_workers_and_points(client, settings, redis):
    a = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    client.post("/v1/jobs", json=mlp_spec())
    client.post("/v1/jobs", json=mlp_spec(priority="high"))
    client.post(f"/v1/jobs/{a}/cancel")
    engine = make_engine(settings.database_url)
    with Session(engine) as db:  # one point first: the counter is the highest id, and tables are emptied per test
        metrics.insert_batch(db, job_id=a, attempt=1, rows=[(0, "warmup", 0.0, utcnow())])
        db.commit()
    ingested = scrape(client)[("trainjobs_metric_points_ingested_total", ())]
    with Session(engine) as db:
        workers.register(db, worker_id="w1", host="h", address="10.0.0.1", device="cpu", slots=2,
                         memory_bytes=2**30, host_memory_bytes=2**30, labels={})
        metrics.insert_batch(db, job_id=a, attempt=1, rows=[(s, "loss", 1.0, utcnow()) for s in range(7)])
        db.commit()
    engine.dispose()
    got = scrape(client)
    assert got[("trainjobs_jobs", (("status", "queued"),))] == 2
    assert got[("trainjobs_jobs", (("status", "cancelled"),))] == 1
    assert got[("trainjobs_jobs", (("status", "running"),))] == 0
    assert got[("trainjobs_queue_depth", (("priority", "normal"),))] == 1
    assert got[("trainjobs_queue_depth", (("priority", "high"),))] == 1
    assert got[("trainjobs_queue_depth", (("priority", "low"),))] == 0
    assert got[("trainjobs_workers", (("device", "cpu"),))] == 1
    assert got[("trainjobs_workers", (("device", "cuda"),))] == 0
    assert got[("trainjobs_metric_points_ingested_total", ())] - ingested == 7  # a counter: its increase
    assert got[("trainjobs_jobs_queued", (("priority", "normal"),))] == 1
    assert got[("trainjobs_jobs_queued", (("priority", "high"),))] == 1


def test_worker_slots_count_live_workers_and_only_idle_ones_as_free(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = make_engine(settings.database_url)
    with Session(engine) as db:
        for name, device, slots in (("idle-cpu", "cpu", 4), ("busy-gpu", "cuda", 8), ("idle-gpu", "cuda", 2),
                                    ("gone-gpu", "cuda", 8)):
            workers.register(db, worker_id=name, host="h", address="10.0.0.1", device=device, slots=slots,
                             memory_bytes=2**34, host_memory_bytes=2**35, labels={})
        workers.occupy(db, worker_id="busy-gpu", job_id=job_id, slots=2)  # the rest of its GPUs are not free
        db.execute(update(Worker).where(Worker.id == "gone-gpu")
                   .values(last_seen=utcnow() - timedelta(seconds=settings.lease_s + 5)))  # silent: lost
        db.commit()
    engine.dispose()
    got = scrape(client)
    assert got[("trainjobs_workers", (("device", "cuda"),))] == 2
    assert got[("trainjobs_worker_slots", (("device", "cuda"),))] == 10
    assert got[("trainjobs_worker_slots_free", (("device", "cuda"),))] == 2
    assert got[("trainjobs_worker_slots", (("device", "cpu"),))] == 4
    assert got[("trainjobs_worker_slots_free", (("device", "cpu"),))] == 4
    types = {f.name: f.type for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert types["trainjobs_metric_points_ingested"] == "counter" and types["trainjobs_worker_slots_free"] == "gauge"


def test_job_wait_and_duration_histograms_come_from_the_jobs_timestamps(client, settings):
    ids = [client.post("/v1/jobs", json=mlp_spec()).json()["id"] for _ in range(3)]
    engine = make_engine(settings.database_url)
    with Session(engine) as db:
        for job_id, end in zip(ids[:2], (JobStatus.SUCCEEDED, JobStatus.FAILED), strict=True):
            assert lifecycle.transition(db, job_id=job_id, to=JobStatus.STARTING, values={"started_at": utcnow()})
            assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING)
            assert lifecycle.transition(db, job_id=job_id, to=end)
        db.commit()
    engine.dispose()
    got = scrape(client)
    assert got[("trainjobs_job_wait_seconds_count", ())] == 2  # the third never started
    assert got[("trainjobs_job_wait_seconds_bucket", (("le", "+Inf"),))] == 2
    assert 0 <= got[("trainjobs_job_wait_seconds_sum", ())] < 60
    assert got[("trainjobs_job_duration_seconds_count", (("status", "succeeded"),))] == 1
    assert got[("trainjobs_job_duration_seconds_count", (("status", "failed"),))] == 1
    assert got[("trainjobs_job_duration_seconds_bucket", (("le", "1.0"), ("status", "failed")))] == 1


def test_request_latency_is_labelled_by_route_template_method_and_status_class(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    client.get(f"/v1/jobs/{job_id}")
    client.get(f"/v1/jobs/{job_id}")
    client.get("/v1/jobs/0123456789abcdef0123")
    got = scrape(client)
    key = "trainjobs_http_request_duration_seconds_count"
    assert got[(key, (("method", "POST"), ("route", "/v1/jobs"), ("status", "2xx")))] == 1
    assert got[(key, (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "2xx")))] == 2
    assert got[(key, (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "4xx")))] == 1
    assert not any(job_id in str(labels) for _name, labels in got)


def test_each_app_has_its_own_registry(settings, redis):
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    for _ in range(2):  # a second app would raise "Duplicated timeseries" on a shared registry
        with TestClient(create_app(settings)) as c:
            c.headers["Authorization"] = f"Bearer {admin_token(settings)}"
            c.post("/v1/jobs", json=mlp_spec())
            key = ("trainjobs_http_request_duration_seconds_count",
                   (("method", "POST"), ("route", "/v1/jobs"), ("status", "2xx")))
            assert scrape(c)[key] == 1


def test_event_streams_are_not_request_latency(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    client.post(f"/v1/jobs/{job_id}/cancel")
    assert client.get(f"/v1/jobs/{job_id}/events").status_code == 200
    assert not any(dict(labels).get("route") == "/v1/jobs/{job_id}/events" for _name, labels in scrape(client))


def test_a_scrape_with_redis_down_still_answers_from_the_database(settings, redis):
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    down = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(down)) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(down)}"
        c.post("/v1/jobs", json=mlp_spec())
        got = scrape(c)
    assert got[("trainjobs_jobs", (("status", "queued"),))] == 1
    assert not any(name == "trainjobs_queue_depth" for name, _labels in got)


def test_the_histograms_seconds_are_exact_on_both_databases(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    created = utcnow() - timedelta(hours=1)
    engine = make_engine(settings.database_url)
    with Session(engine) as db:
        db.execute(update(Job).where(Job.id == job_id).values(
            status=JobStatus.SUCCEEDED.value, created_at=created, started_at=created + timedelta(seconds=7.25),
            finished_at=created + timedelta(seconds=7.25 + 100.5)))
        db.commit()
    engine.dispose()
    got = scrape(client)
    assert got[("trainjobs_job_wait_seconds_bucket", (("le", "5.0"),))] == 0
    assert got[("trainjobs_job_wait_seconds_bucket", (("le", "10.0"),))] == 1
    assert got[("trainjobs_job_wait_seconds_sum", ())] == pytest.approx(7.25, abs=0.01)
    duration = (("le", "60.0"), ("status", "succeeded")), (("le", "300.0"), ("status", "succeeded"))
    assert [got[("trainjobs_job_duration_seconds_bucket", labels)] for labels in duration] == [0, 1]
    assert got[("trainjobs_job_duration_seconds_sum", (("status", "succeeded"),))] == pytest.approx(100.5, abs=0.01)
