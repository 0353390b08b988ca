"""The HTTP API on SQLite and PostgreSQL: submit, read, list, cancel, and the queue entry behind each."""

from rq import Queue
from rq.serializers import JSONSerializer
from sqlalchemy import create_engine, func, select

from service.jobs.models import Job, JobEvent
from service.jobs.queue import JOB_FUNCTION
from tests.conftest import QUEUE_PREFIX, admin_token, mlp_spec


def queued_ids(redis, priority="normal") -> list[str]:
    return Queue(f"{QUEUE_PREFIX}-{priority}", connection=redis, serializer=JSONSerializer).get_job_ids()


def test_submit_stores_job_and_enqueues_it_by_id(client, redis):
    r = client.post("/v1/jobs", json=mlp_spec())
    assert r.status_code == 201
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["attempt"] == 0
    assert job["progress"] == {"step": 0, "total_steps": 20, "eta_s": None}
    assert job["spec"]["optimizer"]["lr"] == 0.01 and job["spec"]["optimizer"]["schedule"] == "constant"
    assert queued_ids(redis) == [job["id"]]
    rq_job = Queue(f"{QUEUE_PREFIX}-normal", connection=redis, serializer=JSONSerializer).fetch_job(job["id"])
    assert rq_job.func_name == JOB_FUNCTION and rq_job.args == [job["id"]]


def test_priority_picks_the_queue(client, redis):
    high = client.post("/v1/jobs", json=mlp_spec(priority="high")).json()
    low = client.post("/v1/jobs", json=mlp_spec(priority="low")).json()
    assert queued_ids(redis, "high") == [high["id"]]
    assert queued_ids(redis, "low") == [low["id"]]


def test_get_returns_what_was_submitted(client):
    created = client.post("/v1/jobs", json=mlp_spec(name="reader")).json()
    job = client.get(f"/v1/jobs/{created['id']}").json()
    for key in ("id", "name", "status", "spec", "attempt", "progress", "summary", "error",
                "created_at", "started_at", "finished_at"):
        assert key in job
    assert job["name"] == "reader" and job["summary"] is None and job["created_at"].endswith(("Z", "+00:00"))


def test_list_is_newest_first_with_keyset_pages(client):
    ids = [client.post("/v1/jobs", json=mlp_spec(name=f"j{i}")).json()["id"] for i in range(5)]
    page1 = client.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in page1["items"]] == ids[::-1][:2]
    page2 = client.get("/v1/jobs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = client.get("/v1/jobs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    assert [j["id"] for j in page2["items"] + page3["items"]] == ids[::-1][2:]
    assert page3["next_cursor"] is None


def test_list_filters_by_status(client):
    a = client.post("/v1/jobs", json=mlp_spec()).json()
    client.post("/v1/jobs", json=mlp_spec())
    client.post(f"/v1/jobs/{a['id']}/cancel")
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}).json()["items"]
    assert [j["id"] for j in cancelled] == [a["id"]]
    assert len(client.get("/v1/jobs", params={"status": "queued"}).json()["items"]) == 1


def test_cancel_of_queued_job_is_immediate_and_leaves_the_queue(client, redis):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200
    assert r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None
    assert queued_ids(redis) == []
    again = client.post(f"/v1/jobs/{job['id']}/cancel")  # idempotent
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_every_transition_is_in_the_audit_trail(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")
    engine = create_engine(settings.database_url)
    with engine.connect() as conn:
        kinds = conn.scalars(select(JobEvent.kind).where(JobEvent.job_id == job["id"]).order_by(JobEvent.id)).all()
    engine.dispose()
    assert kinds == ["queued", "cancelled"]


def test_metrics_and_logs_of_a_new_job_are_empty(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    assert client.get(f"/v1/jobs/{job['id']}/metrics").json() == {"node_rank": 0, "cursor": 0, "series": []}
    r = client.get(f"/v1/jobs/{job['id']}/logs")
    assert r.status_code == 200 and r.text == "" and r.headers["x-next-offset"] == "0"


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "redis": "ok"}


def test_job_is_accepted_even_when_redis_is_down_and_reconciled_later(settings, redis):
    """The row is the truth: an enqueue failure loses nothing, the reconcile pass enqueues it."""
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from service.db import make_engine, make_sessionmaker
    from service.jobs import queue

    down = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(down)) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(down)}"
        r = c.post("/v1/jobs", json=mlp_spec())
        assert r.status_code == 201 and r.json()["status"] == "queued"
        assert c.get("/readyz").status_code == 503
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        assert queue.reconcile(db, redis, prefix=QUEUE_PREFIX, min_age_s=0) == [r.json()["id"]]
        assert queue.reconcile(db, redis, prefix=QUEUE_PREFIX, min_age_s=0) == []  # not twice
        assert db.scalar(select(func.count()).select_from(Job)) == 1
    engine.dispose()
    assert queued_ids(redis) == [r.json()["id"]]


def test_reconcile_drops_queue_entries_of_finished_and_unknown_jobs_and_keeps_the_rest(client, settings, redis):
    from service.db import make_engine, make_sessionmaker
    from service.jobs import queue

    kept, cancelled = (client.post("/v1/jobs", json=mlp_spec()).json()["id"] for _ in range(2))
    assert client.post(f"/v1/jobs/{cancelled}/cancel").json()["status"] == "cancelled"  # a queued job: at once
    queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=cancelled, priority="normal", timeout_s=60)  # a stale hint
    queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id="f" * 20, priority="low", timeout_s=60)  # no such job
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        assert queue.reconcile(db, redis, prefix=QUEUE_PREFIX, min_age_s=0) == []  # kept is held already
    engine.dispose()
    assert queued_ids(redis) == [kept] and queued_ids(redis, "low") == []


def test_a_submission_hands_its_parsed_needs_to_the_sweeper_of_its_process(client, settings):
    """The sweeper's pass then finds the new job's needs kept, as it would have parsed them from the row."""
    from service.db import make_engine, make_sessionmaker
    from service.scheduling import service as scheduling

    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    kept = client.app.state.job_needs[job_id]
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        parsed: dict = {}
        scheduling.snapshot(db, settings, cache=parsed)
    engine.dispose()
    assert kept == parsed[job_id]


def test_the_served_app_freezes_its_startup_heap_out_of_the_collectors_sight(tmp_path):
    """`uvicorn service.api.asgi:app` (trainjobs api, up, compose): the modules and the app, most of the heap, are
    frozen (gc.freeze), so the cyclic collector's full passes under load stop walking them (bench/README.md)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRAINJOBS_DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite",
           "TRAINJOBS_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run([sys.executable, "-c", "import gc, service.api.asgi; print(gc.get_freeze_count())"],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert int(out) > 10_000
