"""`trainjobs status --json`, `list --json`, `workers --json`: the API's answer as plain JSON, for scripts; and the
tables and logs a person reads."""

import json

from service.cli import main as cli
from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.logs import service as logs
from service.workers import service as workers
from tests.conftest import mlp_spec
from trainjobs.client import Client
from trainjobs.states import JobStatus


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


def test_workers_lists_each_worker_as_a_table_or_json(client, settings, capsys):
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        workers.register(db, worker_id="gpu-box:41", host="gpu-box", address="10.0.0.7", device="cuda", slots=8,
                         memory_bytes=80 * 2**30, host_memory_bytes=None, labels={"pool": "a100"})
        db.commit()
    engine.dispose()
    (shown,) = json.loads(run(client, capsys, "workers", "--json"))["items"]
    assert (shown["id"], shown["state"], shown["slots"], shown["labels"]) == ("gpu-box:41", "idle", 8, {"pool": "a100"})
    table = run(client, capsys, "workers")
    assert all(text in table for text in ("gpu-box:41", "idle", "0/8 cuda", "80 GiB", "pool=a100", "s ago"))


def test_logs_node_prints_that_node_s_log_of_a_multi_node_job(client, settings, capsys):
    job = client.post("/v1/jobs", json=mlp_spec(resources={"nnodes": 2, "nproc_per_node": 1})).json()
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        for node in (0, 1):
            logs.append(db, job_id=job["id"], attempt=1, start=0, seq=0, text=f"hello from node {node}\n",
                        node_rank=node)
        db.commit()
    engine.dispose()
    assert run(client, capsys, "logs", job["id"]) == "hello from node 0\n"
    assert run(client, capsys, "logs", job["id"], "--node", "1") == "hello from node 1\n"
    got = json.loads(run(client, capsys, "logs", job["id"], "--node", "1", "--json"))
    assert got["node_rank"] == 1 and got["text"] == "hello from node 1\n"


def test_status_prints_the_users_text_as_text_not_as_markup(client, settings, capsys):
    job = client.post("/v1/jobs", json=mlp_spec(name="marked")).json()
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        for to, values in ((JobStatus.STARTING, {"attempt": 1, "started_at": utcnow()}), (JobStatus.RUNNING, {}),
                           (JobStatus.FAILED, {"finished_at": utcnow(), "summary": {"[red]acc[/]": 0.5},
                                               "error": {"type": "RuntimeError", "message": "[rank0]: boom [/]"}})):
            assert lifecycle.transition(db, job_id=job["id"], to=to, values=values)
        db.commit()
    engine.dispose()
    out = run(client, capsys, "status", job["id"])
    assert "RuntimeError: [rank0]: boom [/]" in out and "[red]acc[/]" in out
