"""The fair pool's routes on both databases (no workers): the queue as each user sees it, teams, users.

GET /v1/queue shows the scheduling pass's plan (the API's assigner thread runs passes, kicked by submissions), and
plans once per request only when no pass left a fresh one.
"""

import threading
from datetime import datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.db import make_engine, make_sessionmaker
from service.jobs import assigner
from service.scheduling import policy, queue_view
from service.workers import service as workers
from tests.conftest import QUEUE_PREFIX, admin_token, mlp_spec
from tests.helpers import wait_for


def user(client, name: str, **fields) -> dict:
    r = client.post("/v1/tokens", json={"name": name, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def after_pass(client, ids: list[str], **kw) -> dict:
    """GET /v1/queue once a pass planned every job in `ids`, the only queued ones (submissions kick a pass)."""
    def seen():
        view = client.get("/v1/queue", **kw).json()
        return view if view["planned_by"] == "pass" and view["waiting"] >= len(ids) else None

    return wait_for(seen, 15, interval=0.05, what=f"a pass that planned {ids}")


def test_the_queue_lists_your_jobs_in_order_with_reasons_and_counts_the_others(client):
    vera, walt = user(client, "vera", team="vision"), user(client, "walt")
    v = [client.post("/v1/jobs", json=mlp_spec(name=f"v{i}"), headers=vera).json()["id"] for i in range(2)]
    w = client.post("/v1/jobs", json=mlp_spec(name="w0", priority="high"), headers=walt).json()["id"]
    mine = after_pass(client, [*v, w], headers=vera)
    assert [(j["id"], j["name"], j["owner"]) for j in mine["jobs"]] == [(v[0], "v0", "vera"), (v[1], "v1", "vera")]
    assert [j["position"] for j in mine["jobs"]] == [2, 3]  # walt's high job is first
    assert mine["jobs"][0]["reason"] == "no live worker"
    assert mine["others_waiting"] == 1 and mine["others_ahead"] == 1
    assert mine["you"]["user"] == "vera" and mine["you"]["team"] == "vision" and mine["policy"] == "fair"
    theirs = client.get("/v1/queue", headers=walt).json()
    assert [j["id"] for j in theirs["jobs"]] == [w] and theirs["others_ahead"] == 0
    assert [j["id"] for j in client.get("/v1/queue").json()["jobs"]] == [w, *v]  # an admin sees everyone's


def test_admins_set_teams_and_users_and_nobody_else_may(client):
    vera = user(client, "vera")
    r = client.put("/v1/teams/vision", json={"weight": 2, "max_slots": 8})
    assert r.status_code == 200 and r.json()["weight"] == 2 and r.json()["max_slots"] == 8
    r = client.patch("/v1/users/vera", json={"team": "vision", "weight": 3, "max_slots": 2})
    assert r.status_code == 200 and (r.json()["team"], r.json()["weight"], r.json()["max_slots"]) == ("vision", 3, 2)
    teams = client.get("/v1/teams", headers=vera).json()["data"]
    assert [(t["name"], t["members"]) for t in teams] == [("vision", ["vera"])]
    assert client.put("/v1/teams/x", json={"weight": 1}, headers=vera).status_code == 403
    assert client.patch("/v1/users/vera", json={"weight": 9}, headers=vera).status_code == 403
    assert client.patch("/v1/users/nobody", json={"weight": 1}).status_code == 404
    r = client.patch("/v1/users/vera", json={"weight": 0})
    assert r.status_code == 422 and "weight" in r.text
    r = client.patch("/v1/users/vera", json={"clear_team": True, "clear_max_slots": True})
    assert (r.json()["team"], r.json()["max_slots"]) == (None, None)
    assert client.get("/v1/users/vera", headers=vera).json()["weight"] == 3
    assert client.get("/v1/users/admin", headers=vera).status_code == 404  # another user's standing is not yours


def test_only_an_admin_may_submit_a_job_that_cannot_be_preempted(client):
    vera = user(client, "vera")
    r = client.post("/v1/jobs", json=mlp_spec(preemptible=False), headers=vera)
    assert r.status_code == 403 and "preemptible" in r.text
    assert client.post("/v1/jobs", json=mlp_spec(preemptible=False)).status_code == 201


def test_the_queue_lists_a_gangs_reservation_naming_the_job_to_its_owner_only(settings, redis):
    settings = settings.model_copy(update={"reserve_after_s": 0})
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        vera, walt = user(client, "vera", multinode=True), user(client, "walt")  # a gang is a right
        gang = mlp_spec(name="gang", resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"})
        gang_id = client.post("/v1/jobs", json=gang, headers=vera).json()["id"]
        engine = create_engine(settings.resolved_database_url)
        with Session(engine) as db:
            for name in ("w1", "w2"):
                workers.register(db, worker_id=name, host=name, address="10.0.0.1", device="cpu", slots=1,
                                 memory_bytes=None, host_memory_bytes=None, labels={})
            db.commit()
        engine.dispose()
        # The pass that sees the two workers (a worker registering kicks none here: wait for its tick).
        wait_for(lambda: client.get("/v1/queue").json()["reservations"], 15, interval=0.05, what="the reservation")
        [mine] = client.get("/v1/queue", headers=vera).json()["reservations"]
        assert (mine["job_id"], mine["workers"], mine["held"]) == (gang_id, 2, 2)
        assert mine["fill_by"] and mine["deadline"] > mine["fill_by"]
        [theirs] = client.get("/v1/queue", headers=walt).json()["reservations"]
        assert theirs["job_id"] is None and theirs["workers"] == 2


class PlanCalls:
    """policy.plan, counting the calls a request makes (the route runs in the server's threadpool; a pass in the
    assigner's thread, or in the test's own for `one_pass`)."""

    def __init__(self, monkeypatch):
        self.by_requests = 0
        self.real = policy.plan
        monkeypatch.setattr(policy, "plan", self)

    def __call__(self, snap):
        if threading.current_thread() is not threading.main_thread() and \
                threading.current_thread().name != "assigner":
            self.by_requests += 1
        return self.real(snap)


@pytest.fixture
def no_pass(settings, redis):
    """The assigner's lock held by the test: the app's passes wait, so the test decides when one runs."""
    lock = redis.lock(assigner.LOCK_KEY.format(prefix=QUEUE_PREFIX), timeout=120)
    assert lock.acquire(blocking=True, blocking_timeout=30)
    yield
    lock.release()


def one_pass(settings, redis) -> assigner.Report:
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as db:
            return assigner.run_pass(db, redis, settings, cache={})
    finally:
        engine.dispose()


def test_the_queue_is_the_passes_plan_and_a_request_plans_nothing(client, settings, redis, monkeypatch):
    vera = user(client, "vera")
    first = client.post("/v1/jobs", json=mlp_spec(name="first"), headers=vera).json()["id"]
    after_pass(client, [first])
    calls = PlanCalls(monkeypatch)
    lock = redis.lock(assigner.LOCK_KEY.format(prefix=QUEUE_PREFIX), timeout=120)
    assert lock.acquire(blocking=True, blocking_timeout=30)  # no pass from here on but the test's own
    try:
        second = client.post("/v1/jobs", json=mlp_spec(name="second"), headers=vera).json()["id"]
        before = client.get("/v1/queue", headers=vera).json()
        # The last pass's plan: the job submitted since is not in it yet, and no request planned.
        assert before["planned_by"] == "pass" and [j["id"] for j in before["jobs"]] == [first]
        report = one_pass(settings, redis)
        after = client.get("/v1/queue", headers=vera).json()
        assert [j["id"] for j in after["jobs"]] == [first, second]
        assert after["planned_by"] == "pass" and after["jobs"][1]["reason"] == "no live worker"
        assert datetime.fromisoformat(after["planned_at"]) > datetime.fromisoformat(before["planned_at"])
        # Its reasons are the pass's: the same words the pass wrote on the job's row.
        assert client.get(f"/v1/jobs/{second}", headers=vera).json()["pending_reason"] == "no live worker"
        assert report.number > 0 and calls.by_requests == 0
    finally:
        lock.release()


def test_without_a_fresh_pass_result_the_route_plans_once_and_says_so(client, settings, redis, monkeypatch,
                                                                     no_pass):
    vera, walt = user(client, "vera"), user(client, "walt")
    v = client.post("/v1/jobs", json=mlp_spec(name="v"), headers=vera).json()["id"]
    w = client.post("/v1/jobs", json=mlp_spec(name="w", priority="high"), headers=walt).json()["id"]
    redis.delete(queue_view.VIEW_KEY.format(prefix=QUEUE_PREFIX))  # Redis flushed, or no pass ran yet
    calls = PlanCalls(monkeypatch)
    mine = client.get("/v1/queue", headers=vera).json()
    assert mine["planned_by"] == "request" and calls.by_requests == 1
    assert [(j["id"], j["position"], j["reason"]) for j in mine["jobs"]] == [(v, 2, "no live worker")]
    assert (mine["others_waiting"], mine["others_ahead"], mine["waiting"]) == (1, 1, 2)
    assert [j["id"] for j in client.get("/v1/queue").json()["jobs"]] == [w, v]  # an admin sees everyone's
    assert calls.by_requests == 2  # each request without a pass result plans once


def test_a_pass_result_past_its_ttl_is_not_served(client, settings, redis, no_pass):
    vera = user(client, "vera")
    job = client.post("/v1/jobs", json=mlp_spec(), headers=vera).json()["id"]
    one_pass(settings, redis)
    key = queue_view.VIEW_KEY.format(prefix=QUEUE_PREFIX)
    assert 0 < redis.pttl(key) <= queue_view.ttl_of(settings) * 1000
    redis.pexpire(key, 1)  # the pass stopped running: its view expires a few sweep_s later
    wait_for(lambda: not redis.exists(key), 5, interval=0.01, what="the view to expire")
    view = client.get("/v1/queue", headers=vera).json()
    assert view["planned_by"] == "request" and [j["id"] for j in view["jobs"]] == [job]
