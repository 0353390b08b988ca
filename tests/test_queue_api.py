"""The fair pool's routes on both databases (no workers): the queue as each user sees it, teams, users."""

from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.workers import service as workers
from tests.conftest import admin_token, mlp_spec


def user(client, name: str, **fields) -> dict:
    r = client.post("/v1/tokens", json={"name": name, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def test_the_queue_lists_your_jobs_in_order_with_reasons_and_counts_the_others(client):
    vera, walt = user(client, "vera", team="vision"), user(client, "walt")
    v = [client.post("/v1/jobs", json=mlp_spec(name=f"v{i}"), headers=vera).json()["id"] for i in range(2)]
    w = client.post("/v1/jobs", json=mlp_spec(name="w0", priority="high"), headers=walt).json()["id"]
    mine = client.get("/v1/queue", headers=vera).json()
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
        [mine] = client.get("/v1/queue", headers=vera).json()["reservations"]
        assert (mine["job_id"], mine["workers"], mine["held"]) == (gang_id, 2, 2)
        assert mine["fill_by"] and mine["deadline"] > mine["fill_by"]
        [theirs] = client.get("/v1/queue", headers=walt).json()["reservations"]
        assert theirs["job_id"] is None and theirs["workers"] == 2
