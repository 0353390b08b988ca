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


def test_sweeps_page_as_jobs_do_and_a_foreign_cursor_is_a_422_naming_it(client):
    """One keyset helper (service/lists.py) pages every list: the cursor is the last id of the page before."""
    body = {"spec": mlp_spec(), "parameters": {"optimizer.lr": {"values": [0.01]}}, "method": "grid",
            "metric": {"name": "loss", "goal": "minimize"}}
    ids = [client.post("/v1/sweeps", json={**body, "name": f"s{i}"}).json()["id"] for i in range(3)]
    page1 = client.get("/v1/sweeps", params={"limit": 2}).json()
    assert [s["id"] for s in page1["items"]] == ids[::-1][:2] and page1["next_cursor"] == ids[1]
    page2 = client.get("/v1/sweeps", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    assert [s["id"] for s in page2["items"]] == ids[:1] and page2["next_cursor"] is None
    for path in ("/v1/jobs", "/v1/sweeps"):
        refused = client.get(path, params={"cursor": "not-a-cursor"})
        assert refused.status_code == 422 and "cursor" in refused.text, (path, refused.text)


def test_a_webhooks_deliveries_page_before_an_id(client):
    hook = client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["job.cancelled"]}).json()
    for i in range(3):  # a queued job cancelled is cancelled at once: one delivery each
        job = client.post("/v1/jobs", json=mlp_spec(name=f"d{i}")).json()
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    newest = client.get(f"/v1/webhooks/{hook['id']}/deliveries", params={"limit": 2}).json()["items"]
    assert len(newest) == 2 and newest[0]["id"] > newest[1]["id"]
    rest = client.get(f"/v1/webhooks/{hook['id']}/deliveries", params={"before": newest[1]["id"]}).json()["items"]
    assert len(rest) == 1 and rest[0]["id"] < newest[1]["id"]
