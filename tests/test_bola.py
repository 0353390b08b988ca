"""Object-level authorization (OWASP API1): another owner's job is a 404 on every route, and stays unchanged."""

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.jobs.models import Job
from tests.conftest import mlp_spec
from tests.test_auth import make_token


def job_routes(app, job_id: str) -> list[tuple[str, str]]:
    routes = []
    for path, item in app.openapi()["paths"].items():
        if "{job_id}" in path:
            routes += [(m.upper(), path.replace("{job_id}", job_id).replace("{name}", "model.pt")) for m in item]
    return routes


def row(settings, job_id: str) -> dict:
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        job = db.get(Job, job_id)
        snapshot = {c.name: getattr(job, c.name) for c in Job.__table__.columns}
    engine.dispose()
    return snapshot


def test_user_b_gets_404_on_every_route_of_user_as_job_and_it_is_unchanged(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob')}"}
    job = client.post("/v1/jobs", json=mlp_spec(name="alices"), headers=alice).json()
    assert job["owner"] == "alice"
    before = row(settings, job["id"])
    routes = job_routes(client.app, job["id"])
    assert {p.split(job["id"])[-1] for _, p in routes} >= {"", "/cancel", "/attempts", "/metrics", "/logs",
                                                            "/events", "/artifacts", "/artifacts/model.pt"}
    unknown = "0" * 20
    for method, path in routes:
        r = client.request(method, path, headers=bob)
        assert r.status_code == 404, (method, path, r.status_code)
        # Indistinguishable from a job that does not exist: no existence leak.
        same = client.request(method, path.replace(job["id"], unknown), headers=bob)
        assert (same.status_code, same.json()["detail"].replace(unknown, job["id"])) == (404, r.json()["detail"])
    # Bob's cancel did nothing. The sweeper may have said meanwhile why the job waits (pending_reason, and the
    # row's version with it): that is the service's write, not bob's.
    sweeper = {"pending_reason", "version"}
    assert {k: v for k, v in row(settings, job["id"]).items() if k not in sweeper} == \
        {k: v for k, v in before.items() if k not in sweeper}
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] == "queued"


def test_listing_shows_a_user_only_their_own_jobs_and_an_admin_all(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob')}"}
    a = client.post("/v1/jobs", json=mlp_spec(name="a"), headers=alice).json()["id"]
    b = client.post("/v1/jobs", json=mlp_spec(name="b"), headers=bob).json()["id"]
    ids = lambda r: [j["id"] for j in r.json()["items"]]  # noqa: E731
    assert ids(client.get("/v1/jobs", headers=bob)) == [b]
    assert ids(client.get("/v1/jobs", params={"owner": "alice"}, headers=bob)) == [b]  # owner is admin-only
    assert ids(client.get("/v1/jobs")) == [b, a]  # the admin, newest first
    assert ids(client.get("/v1/jobs", params={"owner": "alice"})) == [a]


def test_the_owner_and_an_admin_may_cancel(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    first = client.post("/v1/jobs", json=mlp_spec(), headers=alice).json()["id"]
    second = client.post("/v1/jobs", json=mlp_spec(), headers=alice).json()["id"]
    assert client.post(f"/v1/jobs/{first}/cancel", headers=alice).json()["status"] == "cancelled"
    assert client.post(f"/v1/jobs/{second}/cancel").json()["status"] == "cancelled"


def test_own_code_needs_the_users_right_as_well_as_the_workers_switch(client, settings):
    spec = mlp_spec(model=None, data=None, entrypoint={"module": "my_train"})
    plain = {"Authorization": f"Bearer {make_token(settings, 'gina')}"}
    r = client.post("/v1/jobs", json=spec, headers=plain)
    assert r.status_code == 403 and r.json()["field"] == "entrypoint" and "can_run_entrypoints" in r.json()["detail"]
    allowed = {"Authorization": f"Bearer {make_token(settings, 'hank', can_run_entrypoints=True)}"}
    assert client.post("/v1/jobs", json=spec, headers=allowed).status_code == 201
    assert client.get("/v1/jobs", headers=plain).json()["items"] == []  # the refused one left nothing
