"""Resource limits (OWASP API4): body size 413, submission rate 429 + Retry-After, per-owner quota, bounded specs."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.auth.limits import WINDOW_S, take_rate_slot
from tests.conftest import admin_token, mlp_spec
from tests.helpers import count_jobs
from tests.test_auth import make_token


@pytest.fixture
def limited(settings, redis):
    tight = settings.model_copy(update={"submit_rate_per_min": 5, "quota_active_jobs": 3})
    with TestClient(create_app(tight)) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(tight)}"
        yield c


def test_a_body_over_one_mib_is_413_and_stores_nothing(client, settings):
    big = mlp_spec(entrypoint=None, name="big", tags=["x" * 60] * 32)
    big["padding"] = "x" * (2**20 + 1)
    r = client.post("/v1/jobs", json=big)
    assert r.status_code == 413 and r.json()["field"] == "body"

    def chunks():  # no Content-Length: the limit counts what arrives
        for _ in range(17):
            yield b"x" * 65536

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert count_jobs(settings.database_url) == 0


def test_the_rate_limit_is_per_token_and_says_when_to_retry(limited, settings):
    other = {"Authorization": f"Bearer {make_token(settings, 'ivy')}"}
    codes = []
    for _ in range(3):  # the quota (3 active) is not what stops these
        codes.append(limited.post("/v1/jobs", json=mlp_spec()).status_code)
        limited.post(f"/v1/jobs/{limited.get('/v1/jobs').json()['items'][0]['id']}/cancel")
    for _ in range(2):
        codes.append(limited.post("/v1/jobs", json=mlp_spec(priority="low")).status_code)
    assert codes == [201] * 5
    r = limited.post("/v1/jobs", json=mlp_spec())
    assert r.status_code == 429 and "5 submissions a minute" in r.json()["detail"]
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert limited.post("/v1/jobs", json=mlp_spec(), headers=other).status_code == 201  # another token
    assert count_jobs(settings.database_url) == 6


def test_the_quota_counts_an_owners_queued_and_running_jobs(limited, settings):
    jo = {"Authorization": f"Bearer {make_token(settings, 'jo')}"}
    ids = [limited.post("/v1/jobs", json=mlp_spec(), headers=jo).json()["id"] for _ in range(3)]
    r = limited.post("/v1/jobs", json=mlp_spec(), headers=jo)
    assert r.status_code == 429 and r.json()["field"] == "quota" and "3 queued or running" in r.json()["detail"]
    assert limited.post("/v1/jobs", json=mlp_spec()).status_code == 201  # the admin's own quota is untouched
    limited.post(f"/v1/jobs/{ids[0]}/cancel", headers=jo)
    assert limited.post("/v1/jobs", json=mlp_spec(), headers=jo).status_code == 201  # a slot freed
    assert count_jobs(settings.database_url) == 5


@pytest.mark.parametrize("override, field", [
    ({"resources": {"nproc_per_node": 65, "device": "cpu"}}, "nproc_per_node"),
    ({"resources": {"nnodes": 1025}}, "nnodes"),
    ({"train": {"max_steps": 100_000_001}}, "max_steps"),
    ({"model": {"type": "gpt", "d_model": 16385}}, "d_model"),
    ({"model": {"type": "mlp", "hidden": [8] * 33}}, "hidden"),
    ({"name": "n" * 129}, "name"),
    ({"tags": ["t"] * 33}, "tags"),
    ({"tags": ["t" * 65]}, "tags"),
    ({"data": {"type": "synthetic_regression", "seed": 2**32}}, "seed"),
    ({"fault_injection": {"raise_at_step": 10**12}}, "raise_at_step"),
])
def test_every_spec_size_is_bounded_and_a_breach_names_the_field(client, settings, override, field):
    r = client.post("/v1/jobs", json=mlp_spec(**override))
    assert r.status_code == 422
    assert any(field in map(str, e["loc"]) for e in r.json()["detail"]), r.json()
    assert count_jobs(settings.database_url) == 0


def test_tags_are_kept_with_the_job(client):
    job = client.post("/v1/jobs", json=mlp_spec(tags=["team=vision", "sweep/3"])).json()
    assert job["spec"]["tags"] == ["team=vision", "sweep/3"]


@pytest.mark.parametrize("path", ["/v1/jobs?owner=%00", "/v1/jobs/abc%00/metrics?name=x", "/v1/tokens/%00"])
def test_a_nul_byte_in_the_url_is_a_422_not_a_database_error(client, path):
    method = "DELETE" if path.startswith("/v1/tokens") else "GET"
    r = client.request(method, path)
    assert r.status_code == 422 and "NUL" in r.json()["detail"]


def test_a_token_name_with_a_nul_byte_is_refused(client):
    r = client.post("/v1/tokens", json={"name": "\u0000"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "name"


def test_requests_at_once_never_take_more_slots_than_the_rate_allows(redis):
    key = f"ratetest:{uuid.uuid4().hex}"
    with ThreadPoolExecutor(max_workers=16) as pool:
        waits = list(pool.map(lambda _: take_rate_slot(redis, key, 5), range(40)))
    assert waits.count(None) == 5  # the check and the take are one step: no two requests took the last slot
    assert all(0 < wait <= WINDOW_S for wait in waits if wait is not None)
    assert redis.zcard(key) == 5 and 0 < redis.ttl(key) <= WINDOW_S + 1
