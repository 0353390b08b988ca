"""Hostile but well-formed input: non-finite numbers, huge integers, other owners' jobs on a worker; never a 500."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.api.events import parse_cursor
from service.errors import InvalidRequest
from service.workers import service as workers
from tests.conftest import mlp_spec
from tests.helpers import count_jobs
from tests.test_auth import make_token
from trainjobs.spec import JobSpec

ROOT = Path(__file__).resolve().parent.parent
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def strict_json(text: str):
    """The answer parsed as strict JSON: a NaN or Infinity in it fails the test."""
    def refuse(token: str):
        raise AssertionError(f"the answer is not strict JSON: it holds {token}")
    return json.loads(text, parse_constant=refuse)


def post_raw(client, path: str, body: dict):
    """POST the body as Python's json writes it: NaN, Infinity and -Infinity as bare tokens."""
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def set_at(body: dict, path: str, value) -> dict:
    node = body
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return body


SPEC_FLOATS = ["optimizer.lr", "timeout_s", "resources.gpu_memory_gb", "data.noise"]


@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
@pytest.mark.parametrize("field", SPEC_FLOATS)
@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
def test_a_non_finite_number_in_a_spec_is_a_422_naming_the_field(client, settings, route, field, value):
    r = post_raw(client, route, set_at(mlp_spec(), field, value))
    assert r.status_code == 422, r.text
    detail = strict_json(r.text)["detail"]
    assert ["body", *field.split(".")] in [e["loc"] for e in detail], detail
    assert "finite" in detail[0]["msg"]
    assert count_jobs(settings.database_url) == 0


def test_a_non_finite_number_where_the_spec_wants_something_else_is_a_422_too(client, settings):
    spec = mlp_spec(tags=[float("nan")], optimizer={"type": "adamw", "lr": 0.01, "betas": [float("inf"), 0.9]})
    spec["labels"] = {"x": float("-inf")}  # a field the spec does not know: refused as strict JSON first
    r = post_raw(client, "/v1/jobs", spec)
    assert r.status_code == 422, r.text
    locs = [e["loc"] for e in strict_json(r.text)["detail"]]
    assert ["body", "tags", 0] in locs and ["body", "optimizer", "betas", 0] in locs and ["body", "labels", "x"] in locs
    assert count_jobs(settings.database_url) == 0


def test_a_number_too_large_for_a_float_is_refused_like_infinity(client, settings):
    raw = json.dumps(mlp_spec()).replace('"lr": 0.01', '"lr": 1e999')
    r = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and strict_json(r.text)["detail"][0]["loc"] == ["body", "optimizer", "lr"]


@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
def test_a_non_finite_number_in_a_token_request_is_a_422_naming_the_field(client, value):
    r = post_raw(client, "/v1/tokens", {"name": "carol", "expires_in_s": value})
    assert r.status_code == 422, r.text
    assert strict_json(r.text)["detail"][0]["loc"] == ["body", "expires_in_s"]
    assert "carol" not in [t["name"] for t in client.get("/v1/tokens").json()["data"]]


def test_a_spec_built_in_python_refuses_a_non_finite_number_by_name():
    with pytest.raises(ValidationError, match=r"optimizer\.betas\.0\n  Input should be a finite number"):
        JobSpec.model_validate(mlp_spec(optimizer={"type": "adamw", "lr": 0.01, "betas": [float("nan"), 0.9]}))


def test_a_finite_spec_written_by_python_is_still_accepted(client):
    assert post_raw(client, "/v1/jobs", mlp_spec()).status_code == 201


@pytest.mark.parametrize("offset", [2**31, 2**63, 10**30])
def test_a_log_offset_past_any_log_is_a_422_naming_it(client, offset):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    r = client.get(f"/v1/jobs/{job['id']}/logs", params={"offset": offset})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", "offset"]


def test_the_largest_log_offset_answers_an_empty_page(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    r = client.get(f"/v1/jobs/{job['id']}/logs", params={"offset": 2**31 - 1})
    assert r.status_code == 200 and r.content == b"" and r.headers["X-Next-Offset"] == str(2**31 - 1)


@pytest.mark.parametrize("after_step", [2**31, 2**63, 10**30])
def test_an_after_step_past_any_step_is_a_422_naming_it(client, after_step):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    for extra in ({}, {"max_points": 10}):
        r = client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": after_step, **extra})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["query", "after_step"]
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": 2**31 - 1}).json()["series"] == []


def cancelled_job(client) -> str:
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    return job_id


@pytest.mark.parametrize("last_event_id", ["9" * 23, str(2**63)])
def test_a_last_event_id_this_stream_never_sent_is_a_422_before_the_stream(client, last_event_id):
    job_id = cancelled_job(client)
    r = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_event_id})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "Last-Event-ID"


def test_a_last_event_id_of_other_digits_than_ascii_is_refused():
    # A header's bytes are read as latin-1, where "\xb2" is "²": a digit to str.isdigit, not to int().
    with pytest.raises(InvalidRequest, match="Last-Event-ID"):
        parse_cursor("\u00b2")


def test_the_largest_last_event_id_streams_to_the_end(client):
    job_id = cancelled_job(client)
    r = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(2**63 - 1)})
    assert r.status_code == 200 and '"status": "cancelled"' in r.text


def test_workers_show_another_owners_job_only_to_an_admin(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob')}"}
    alices_job = client.post("/v1/jobs", json=mlp_spec(), headers=alice).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        workers.register(db, worker_id="w1", host="h", address="127.0.0.1", device="cpu", slots=2,
                         memory_bytes=None, host_memory_bytes=None, labels={})
        workers.occupy(db, worker_id="w1", job_id=alices_job, slots=2)
        db.commit()
    engine.dispose()

    def shown(headers=None) -> dict:
        [worker] = client.get("/v1/workers", headers=headers).json()["items"]
        return worker

    assert shown(alice)["current_job"] == alices_job
    assert shown()["current_job"] == alices_job  # the admin
    as_bob = shown(bob)
    assert as_bob["current_job"] is None
    assert (as_bob["state"], as_bob["busy_slots"]) == ("busy", 2)  # the worker is busy all the same


def test_collecting_the_tests_needs_no_database(tmp_path):
    """A fresh machine: collection builds no app against a database no fixture has migrated yet."""
    env = {**os.environ, "TRAINJOBS_TEST_POSTGRES_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/no_such_db"}
    env.pop("PYTEST_XDIST_WORKER", None)  # a plain run, not one more xdist worker on this worker's databases
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
                          "tests/test_schemathesis.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
