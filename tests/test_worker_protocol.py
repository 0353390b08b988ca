"""The worker protocol's one registry (issue 42, service/runners/protocol.py): a call answers the same over HTTP
with a worker credential as in-process for a worker that holds the database's URL, checks the caller owns the
attempt, and names the field of bad input either way."""

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import lifecycle
from tests.conftest import mlp_spec
from tests.test_worker_join import as_worker, join, join_token
from worker.control import DatabaseControl, Refused


def test_a_call_is_the_same_over_http_and_in_process_and_only_for_the_attempts_owner(client, settings):
    mine = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="gpu-7-5", lease_s=10)
        db.commit()
    body = {"job_id": job_id, "attempt": attempt, "phase": "installing 2 requirement(s)"}
    assert client.post("/v1/worker/phase", json=body, headers=as_worker(mine)).status_code == 204
    assert client.get(f"/v1/jobs/{job_id}").json()["pending_reason"] == "installing 2 requirement(s)"
    refused = client.post("/v1/worker/phase", json=body, headers=as_worker(other))
    assert refused.status_code == 403 and "gpu-8" in refused.json()["detail"]
    assert client.post("/v1/worker/phase", json=body).status_code == 401  # a user's token
    bad = client.post("/v1/worker/phase", json={**body, "attempt": 0}, headers=as_worker(mine))
    assert bad.status_code == 422 and "attempt" in bad.text

    control = DatabaseControl(sessionmaker(engine), settings)
    assert control.call("phase", {**body, "phase": "launching torchrun"}) is None
    assert client.get(f"/v1/jobs/{job_id}").json()["pending_reason"] == "launching torchrun"
    with pytest.raises(Refused) as refused_here:
        control.call("phase", {**body, "attempt": 0})
    assert refused_here.value.status == 422 and "attempt" in refused_here.value.detail
    engine.dispose()
