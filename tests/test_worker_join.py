"""A machine joins the pool with a credential of its own (issue 42, first step of the worker protocol): an admin's
join token is exchanged once for a worker credential; the worker registers and beats through the API with it;
it is refused on every user route, a user's token is refused on the worker's, a worker acts only on its own rows,
and a revoked credential stops its worker, which hands its job back."""

import os
import subprocess
import sys

import psutil

from tests.conftest import admin_token, mlp_spec
from tests.helpers import live_stack, stack_cli, wait_for

INVENTORY = {"host": "gpu-7", "address": "10.0.0.7", "device": "cpu", "slots": 2, "memory_bytes": 2**30,
             "host_memory_bytes": 2**32, "labels": {"rack": "a"}, "max_jobs": 1}


def join_token(client, **body) -> str:
    response = client.post("/v1/worker-tokens", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["token"].startswith("tjj_")
    return response.json()["token"]


def join(client, token: str, runner: str) -> dict:
    return client.post("/v1/worker/join", json={"runner": runner}, headers={"Authorization": f"Bearer {token}"})


def as_worker(credential: str) -> dict:
    return {"Authorization": f"Bearer {credential}"}


def test_a_join_token_is_spent_by_its_uses_and_gives_each_machine_one_credential(client):
    token = join_token(client, uses=2, expires_in_s=3600)
    first = join(client, token, "gpu-7")
    assert first.status_code == 201 and first.json()["credential"].startswith("tjw_")
    again = join(client, token, "gpu-7")  # the same machine joining again: its first credential is revoked
    assert again.status_code == 201
    spent = join(client, token, "gpu-8")
    assert spent.status_code == 401 and "join token" in spent.json()["detail"]
    beat = {"worker_id": "gpu-7-1", "draining": False}
    assert client.post("/v1/worker/heartbeat", json=beat,
                       headers=as_worker(first.json()["credential"])).status_code == 401
    assert client.post("/v1/worker/heartbeat", json=beat,
                       headers=as_worker(again.json()["credential"])).json() == {"registered": False}
    listed = client.get("/v1/runners").json()
    assert [(r["runner"], r["revoked_at"] is not None) for r in listed] == [("gpu-7", True), ("gpu-7", False)]
    assert "token" not in client.get("/v1/worker-tokens").json()[0] or \
        client.get("/v1/worker-tokens").json()[0]["token"] is None  # the secret is shown once


def test_a_worker_credential_opens_no_user_route_and_a_user_token_no_worker_route(client):
    credential = join(client, join_token(client), "gpu-7").json()["credential"]
    for path in ("/v1/jobs", "/v1/workers", "/v1/me", "/v1/runners"):
        answer = client.get(path, headers=as_worker(credential))
        assert answer.status_code == 401, (path, answer.text)
    refused = client.post("/v1/worker/register", json={"worker_id": "gpu-7-1", **INVENTORY})  # the admin's token
    assert refused.status_code == 401 and "worker's credential" in refused.json()["detail"]
    assert client.post("/v1/worker/join", json={"runner": "gpu-9"}).status_code == 401  # a user's token joins nothing
    user = client.post("/v1/tokens", json={"name": "u", "user": "alice"}).json()["token"]
    made = client.post("/v1/worker-tokens", json={}, headers={"Authorization": f"Bearer {user}"})
    assert made.status_code == 403


def test_a_worker_registers_and_beats_only_its_own_rows(client):
    credential = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    assert client.post("/v1/worker/register", json={"worker_id": "gpu-7-41", **INVENTORY},
                       headers=as_worker(credential)).status_code == 204
    row = next(w for w in client.get("/v1/workers").json()["items"] if w["id"] == "gpu-7-41")
    assert row["host"] == "gpu-7" and row["labels"]["rack"] == "a"
    beat = client.post("/v1/worker/heartbeat", json={"worker_id": "gpu-7-41", "pressure": "disk 95% full"},
                       headers=as_worker(credential))
    assert beat.json() == {"registered": True}
    for worker_id in ("gpu-7-41", "gpu-70-1"):  # another runner's row; a name that is not its own
        refused = client.post("/v1/worker/heartbeat", json={"worker_id": worker_id}, headers=as_worker(other))
        assert refused.status_code == 403 and refused.json()["field"] == "worker_id", refused.text
    assert client.delete("/v1/worker/workers/gpu-7-41", headers=as_worker(other)).status_code == 403
    assert client.delete("/v1/worker/workers/gpu-7-41", headers=as_worker(credential)).status_code == 204
    assert all(w["id"] != "gpu-7-41" for w in client.get("/v1/workers").json()["items"])


def test_bad_input_to_the_worker_routes_names_the_field(client):
    credential = join(client, join_token(client), "gpu-7").json()["credential"]
    bad = client.post("/v1/worker/register", json={"worker_id": "gpu-7-1", **INVENTORY, "slots": 0},
                      headers=as_worker(credential))
    assert bad.status_code == 422 and "slots" in bad.text
    assert join(client, join_token(client), "../etc").status_code == 422
    assert client.post("/v1/worker-tokens", json={"expires_in_s": 5}).status_code == 422
    assert client.post("/v1/runners/nobody/revoke").status_code == 404


def test_a_joined_worker_runs_jobs_and_a_revoked_one_hands_its_job_back_and_stops(postgres_url, tmp_path):
    with live_stack(postgres_url, tmp_path / "stack", name="join", workers=0) as stack:
        trainjobs = stack_cli(stack, cwd=tmp_path, config=tmp_path / "config.toml")
        with stack.client(timeout=10) as api:
            made = trainjobs("worker-token", "create", "--uses", "1", "--expires", "1h")  # an admin, as a user would
            assert made.returncode == 0 and "shown only now" in made.stderr, made.stderr
            token = made.stdout.strip()
            env = {"TRAINJOBS_WORKER_API": stack.api_url, "TRAINJOBS_WORKER_JOIN_TOKEN": token,
                   "TRAINJOBS_WORKER_NAME": "gpu-7", "TRAINJOBS_WORKER_CREDENTIAL_FILE": str(tmp_path / "cred")}
            stack.add_workers(1, env=env)
            wait_for(lambda: any(w["id"] == "gpu-7" for w in api.get("/v1/workers").json()["items"]), 120,
                     what="the joined worker to register through the API")
            assert (tmp_path / "cred").stat().st_mode & 0o777 == 0o600
            slow = mlp_spec(train={"max_steps": 100_000, "log_every": 50, "seed": 0, "checkpoint_every": 50})
            job_id = api.post("/v1/jobs", json=slow).json()["id"]
            wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 120, what="it to run")
            [worker] = [p for p in stack_workers(stack)]
            revoked = trainjobs("runner", "revoke", "gpu-7")
            assert revoked.returncode == 0 and "hands its jobs back" in revoked.stderr, revoked.stderr
            wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 60,
                     what="the revoked worker to stop")
            job = api.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] == "queued", job  # handed back, its retries unspent
            [row] = [w for w in api.get("/v1/workers").json()["items"] if w["id"] == "gpu-7"]
            assert row["state"] in ("draining", "lost"), row  # no job is placed on it again
            api.post(f"/v1/jobs/{job_id}/cancel")


def stack_workers(stack) -> list[psutil.Process]:
    return [psutil.Process(p.pid) for name, p in stack.procs if name.startswith("worker")]


def test_a_worker_renews_only_its_own_attempts_leases_and_learns_a_cancel(client, settings):
    """POST /v1/worker/leases: by the database's clock, what the job asks (a cancel), a lost attempt as null."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.jobs import lifecycle

    credential = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="gpu-7-5", lease_s=10)
        db.commit()
    engine.dispose()
    mine = {"attempts": [{"job_id": job_id, "attempt": attempt, "node_rank": 0}]}
    [lease] = client.post("/v1/worker/leases", json=mine, headers=as_worker(credential)).json()["leases"]
    assert lease["held"]["cancel_requested"] is False
    refused = client.post("/v1/worker/leases", json=mine, headers=as_worker(other))
    assert refused.status_code == 403 and refused.json()["field"] == "attempts"
    client.post(f"/v1/jobs/{job_id}/cancel")
    [lease] = client.post("/v1/worker/leases", json=mine, headers=as_worker(credential)).json()["leases"]
    assert lease["held"]["cancel_requested"] is True
    stale = {"attempts": [{"job_id": job_id, "attempt": attempt + 1, "node_rank": 0}]}  # no such attempt
    [lease] = client.post("/v1/worker/leases", json=stale, headers=as_worker(credential)).json()["leases"]
    assert lease["held"] is None


def test_an_operator_s_join_token_file_lets_machines_join_from_the_api_s_start_and_a_bad_one_stops_it(settings,
                                                                                                     redis, tmp_path):
    """TRAINJOBS_JOIN_TOKEN_FILE (a compose file's workers join with it, as k3s's server token): accepted from the
    API's start, any number of machines; revoked by an admin, it stays revoked across restarts; a file holding no
    join token stops the start, naming it."""
    import pytest
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    token_file = tmp_path / "join_token"
    token_file.write_text("tjj_" + "ab12" * 16 + "\n")
    with_file = settings.model_copy(update={"join_token_file": token_file})
    with TestClient(create_app(with_file)) as client:
        first = join(client, token_file.read_text().strip(), "gpu-7")
        second = join(client, token_file.read_text().strip(), "gpu-8")
        assert first.status_code == 201 and second.status_code == 201, first.text
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        [row] = [t for t in client.get("/v1/worker-tokens").json() if t["created_by"] == "TRAINJOBS_JOIN_TOKEN_FILE"]
        assert row["expires_at"] is None and row["uses_left"] is None
        assert client.delete(f"/v1/worker-tokens/{row['id']}").status_code == 200
    with TestClient(create_app(with_file)) as client:  # restarted: the revoked token is not made live again
        assert join(client, token_file.read_text().strip(), "gpu-9").status_code == 401
    token_file.write_text("hunter2")
    with pytest.raises(RuntimeError, match="holds no join token"), TestClient(create_app(with_file)):
        pass


def test_a_worker_given_no_api_is_refused_unless_asked_to_write_the_database_itself(postgres_url, tmp_path):
    """A worker holds no database URL (issue 42): `trainjobs worker` with only the database's refuses to start,
    naming how to join; TRAINJOBS_WORKER_DATABASE=1 is the by-name way to a database worker (tests, one machine)."""
    env = {k: v for k, v in os.environ.items() if k != "TRAINJOBS_WORKER_DATABASE"}
    env |= {"TRAINJOBS_DATABASE_URL": postgres_url, "TRAINJOBS_DATA_DIR": str(tmp_path / "data"),
            "TMPDIR": str(tmp_path)}
    refused = subprocess.run([sys.executable, "-m", "worker.main", "--burst"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "--api URL with --join-token" in refused.stderr and "TRAINJOBS_WORKER_DATABASE=1" in refused.stderr
