"""`trainjobs status --json` and `trainjobs list --json`: the API's answer as plain JSON, for scripts."""

import json

from service import cli
from service.client import Client
from tests.conftest import mlp_spec


def run(client, capsys, *argv: str) -> str:
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app
    args = cli.build_parser().parse_args(list(argv))
    assert args.remote(args, api) == 0
    return capsys.readouterr().out


def test_status_and_list_with_json_print_what_the_api_returns(client, capsys):
    job = client.post("/v1/jobs", json=mlp_spec(name="scripted")).json()
    status = json.loads(run(client, capsys, "status", job["id"], "--json"))
    assert status["id"] == job["id"] and status["status"] == "queued" and status["progress"]["total_steps"] == 20
    page = json.loads(run(client, capsys, "list", "--json", "--status", "queued"))
    assert [j["id"] for j in page["items"]] == [job["id"]] and page["next_cursor"] is None


def test_status_without_json_is_a_readable_table(client, capsys):
    job = client.post("/v1/jobs", json=mlp_spec(name="readable")).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")
    out = run(client, capsys, "status", job["id"])
    assert "readable" in out and "cancelled" in out and "0/20" in out
    assert job["id"] in run(client, capsys, "list")
