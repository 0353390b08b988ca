"""Every list of the API answers `items`; the eight that answered `data` keep it for a release, marked deprecated
(service/lists.py, CHANGELOG.md)."""

import pytest

from tests.conftest import mlp_spec


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"webhook_allow": "127.0.0.1"})  # a webhook on loopback, never called here


def test_every_list_answers_items_and_the_old_data_is_the_same_list(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    sweep = client.post("/v1/sweeps", json={"name": "s", "spec": mlp_spec(), "parameters": {
        "optimizer.lr": {"values": [0.01, 0.02]}}, "method": "grid", "metric": {"name": "loss", "goal": "minimize"}})
    assert sweep.status_code in (200, 201), sweep.text
    hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"})
    assert hook.status_code in (200, 201), hook.text
    lists = ["/v1/tokens", "/v1/teams", "/v1/webhooks", f"/v1/webhooks/{hook.json()['id']}/deliveries",
             "/v1/packages", f"/v1/jobs/{job}/attempts", f"/v1/sweeps/{sweep.json()['id']}/trials"]
    for path in lists:
        body = client.get(path).json()
        assert "items" in body and body["data"] == body["items"], (path, body)
    assert len(client.get(f"/v1/sweeps/{sweep.json()['id']}/trials").json()["items"]) == 2
    for path in ("/v1/jobs", "/v1/workers", "/v1/sweeps"):  # the lists that always answered items
        assert "items" in client.get(path).json()


def test_the_openapi_schema_marks_the_old_data_deprecated(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("TokensPublic", "TeamsPublic", "WebhooksPublic", "DeliveriesPublic", "PackagesPublic",
                 "AttemptsPublic", "TrialsPublic"):
        props = schemas.get(f"{name}-Output", schemas.get(name))["properties"]
        assert "items" in props and props["data"].get("deprecated") is True, (name, props.get("data"))
