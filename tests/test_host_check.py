"""With TRAINJOBS_AUTH=off every caller is admin, so a request must be addressed to a loopback name: a web page
that re-binds its DNS name to 127.0.0.1 (DNS rebinding) reaches the port from the browser, with its own Host."""

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from tests.conftest import mlp_spec


@pytest.fixture
def local(settings, redis) -> TestClient:
    """A client on an auth-off app, served on loopback as `trainjobs api` serves it."""
    off = settings.model_copy(update={"auth": False})
    with TestClient(create_app(off), base_url="http://127.0.0.1:8000") as c:
        yield c


def test_with_auth_off_a_request_for_another_host_is_refused_naming_the_host(local):
    r = local.post("/v1/jobs", json=mlp_spec(), headers={"Host": "evil.example"})
    assert r.status_code == 403
    assert r.json()["field"] == "Host" and "evil.example" in r.json()["detail"]
    assert local.get("/v1/jobs").json()["items"] == []  # nothing was submitted
    for path in ("/v1/jobs", "/v1/workers", "/metrics"):
        assert local.get(path, headers={"Host": "evil.example:8000"}).status_code == 403, path


def test_with_auth_off_the_dashboards_event_stream_is_refused_for_another_host(local):
    job = local.post("/v1/jobs", json=mlp_spec()).json()
    r = local.get(f"/v1/jobs/{job['id']}/events", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["field"] == "Host"


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "127.0.0.1", "localhost", "localhost:8000", "LOCALHOST",
                                  "127.1.2.3:80", "[::1]:8000", "[::1]"])
def test_with_auth_off_a_loopback_host_is_served(local, host):
    r = local.get("/v1/jobs", headers={"Host": host})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "localhost.evil.example", "127.0.0.1.evil.example",
                                  "10.1.2.3:8000", "[::2]:8000", "", "testserver"])
def test_with_auth_off_a_host_that_only_looks_local_is_refused(local, host):
    assert local.get("/v1/jobs", headers={"Host": host}).status_code == 403


def test_with_auth_on_the_host_header_is_not_checked(client):
    """Tokens protect an auth-on API: a page cannot read the token, whatever name it reaches the API by."""
    r = client.post("/v1/jobs", json=mlp_spec(), headers={"Host": "evil.example"})
    assert r.status_code == 201, r.text
