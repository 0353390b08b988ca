"""Idempotent submission: a retried POST with the same Idempotency-Key never makes a second job."""

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor, wait

import httpx
import pytest
from sqlalchemy import create_engine, select

from service.cli.stack import Stack
from service.db import utcnow
from service.jobs.models import Job
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL, _empty_tables, mlp_spec
from tests.helpers import free_port, queued_ids, wait_for


def rows(url: str) -> list[Job]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = list(conn.execute(select(Job.id, Job.owner, Job.idempotency_key)))
    engine.dispose()
    return found


def post(client, spec: dict, key: str):
    return client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": key})


def test_same_key_and_spec_returns_the_first_job_with_200_and_enqueues_nothing(client, settings, redis):
    first = post(client, mlp_spec(), "k-1")
    again = post(client, mlp_spec(), "k-1")
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"] == f"/v1/jobs/{first.json()['id']}"
    assert [r.id for r in rows(settings.database_url)] == [first.json()["id"]]
    assert queued_ids(redis, prefix=QUEUE_PREFIX) == [first.json()["id"]]


def test_same_key_with_another_spec_is_409_naming_the_header(client, settings):
    job = post(client, mlp_spec(), "k-1").json()
    r = post(client, mlp_spec(name="other"), "k-1")
    assert r.status_code == 409
    assert r.json()["field"] == "Idempotency-Key" and job["id"] in r.json()["detail"]
    assert len(rows(settings.database_url)) == 1


def test_auto_spec_matches_what_was_sent_not_what_it_resolved_to(client):
    first = post(client, mlp_spec(strategy="auto"), "auto-1")
    assert first.status_code == 201 and first.json()["spec"]["strategy"] == "ddp"
    again = post(client, mlp_spec(strategy="auto"), "auto-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    # The body the plan resolved to is another request: the client sent "ddp", not "auto".
    assert post(client, mlp_spec(strategy="ddp"), "auto-1").status_code == 409


def test_keys_are_per_owner(client, settings):
    engine = create_engine(settings.database_url)
    with engine.begin() as conn:
        conn.execute(Job.__table__.insert().values(
            id="0" * 20, owner="alice", name="hers", spec=mlp_spec(), spec_hash="x" * 64, status="queued",
            priority="normal", idempotency_key="shared", attempt=0, max_retries=0, created_at=utcnow()))
    engine.dispose()
    r = post(client, mlp_spec(), "shared")
    assert r.status_code == 201 and r.json()["id"] != "0" * 20 and r.json()["owner"] == "admin"
    assert sorted((row.owner, row.idempotency_key) for row in rows(settings.database_url)) == [
        ("admin", "shared"), ("alice", "shared")]


@pytest.mark.parametrize("key", ["", "k" * 129])
def test_empty_or_too_long_key_is_422_naming_the_header(client, settings, key):
    r = post(client, mlp_spec(), key)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    assert rows(settings.database_url) == []


def test_a_key_of_128_chars_is_accepted_and_no_key_makes_a_new_job_each_time(client, settings):
    assert post(client, mlp_spec(), "k" * 128).status_code == 201
    assert client.post("/v1/jobs", json=mlp_spec()).status_code == 201
    assert client.post("/v1/jobs", json=mlp_spec()).status_code == 201
    assert len(rows(settings.database_url)) == 3


@pytest.fixture
def pg(postgres_url, redis) -> str:
    _empty_tables(postgres_url)
    return postgres_url


def api_settings(tmp_path, url: str, **overrides) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=url, redis_url=REDIS_URL,
                    queue_prefix=f"{QUEUE_PREFIX}idem", **{"submit_rate_per_min": 10_000, **overrides})


def test_concurrent_duplicates_make_exactly_one_job(pg, redis, tmp_path):
    """20 requests with one key reach a real API at once: one INSERT wins, the rest answer with its job."""
    n = 20
    barrier = threading.Barrier(n)

    def submit(_):
        with stack.client(timeout=60) as api:
            api.get("/healthz")  # connected before the barrier, so the POSTs really race
            barrier.wait()
            return post(api, mlp_spec(), "race")

    with Stack(api_settings(tmp_path, pg), port=free_port(), workers=0, quiet=True) as stack:
        with ThreadPoolExecutor(n) as pool:
            responses = list(pool.map(submit, range(n)))
    assert sorted(r.status_code for r in responses) == [200] * (n - 1) + [201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert [r.id for r in rows(pg)] == [responses[0].json()["id"]]
    assert queued_ids(redis, prefix=f"{QUEUE_PREFIX}idem") == [responses[0].json()["id"]]


def test_api_killed_mid_submissions_keeps_every_201_and_retries_make_no_second_job(pg, redis, tmp_path):
    """SIGKILL the API while 100 submissions are in flight: a 201 is a job; a retry of any key is one job."""
    keys = [f"crash-{uuid.uuid4().hex}" for _ in range(100)]

    def submit(api: httpx.Client, key: str):
        try:
            return post(api, mlp_spec(), key)
        except httpx.HTTPError:  # the API died under this request, or before it
            return None

    stack = Stack(api_settings(tmp_path, pg), port=free_port(), workers=0, quiet=True)
    with stack, stack.client(timeout=30) as api, ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(submit, api, key) for key in keys]
        wait_for(lambda: sum(f.done() for f in futures) >= 30, 60, interval=0.005, what="30 answers")
        dict(stack.procs)["api"].kill()
        wait(futures)
    first = dict(zip(keys, (f.result() for f in futures), strict=True))
    created = {k: r.json()["id"] for k, r in first.items() if r is not None}
    assert all(r.status_code == 201 for r in first.values() if r is not None), "an answer other than 201"
    assert 30 <= len(created) < 100, f"{len(created)} answered: the kill came too late to test anything"
    stored = {row.idempotency_key: row.id for row in rows(pg)}
    assert {k: stored.get(k) for k in created} == created  # every 201 has its job

    # A fast sweeper, so the jobs the kill caught between COMMIT and enqueue reach the queue.
    restarted = api_settings(tmp_path, pg, reconcile_s=1)
    with Stack(restarted, port=free_port(), workers=0, quiet=True) as stack:
        with stack.client(timeout=30) as api:
            retries = {k: post(api, mlp_spec(), k) for k in keys}
            # NOTE: the killed API may have died holding the sweeper's lock; a new one waits for it to expire.
            wait_for(lambda: len(queued_ids(redis, prefix=restarted.queue_prefix)) >= 100, 90,
                     what="the reconciler to enqueue every job")
    for key, r in retries.items():
        assert (r.status_code, r.json()["id"]) == ((200, stored[key]) if key in stored else (201, r.json()["id"]))
    final = rows(pg)
    assert len(final) == 100 and {row.idempotency_key for row in final} == set(keys)
    assert sorted(queued_ids(redis, prefix=restarted.queue_prefix)) == sorted(row.id for row in final)
