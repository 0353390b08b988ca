"""Webhooks end to end: a real API (uvicorn), a real worker running tiny CPU jobs, PostgreSQL, Redis, and a
receiver on loopback (allowed for this stack by TRAINJOBS_WEBHOOK_ALLOW). Short backoff settings, so a receiver
that was down gets its events within a second of coming back."""

import json
import sys
from collections import Counter

from sqlalchemy import create_engine, select

from service.cli.main import build_parser
from service.jobs.models import Job
from tests.conftest import mlp_spec
from tests.helpers import Receiver, module_stack, wait_for, wait_terminal
from trainjobs import webhooks as signing
from trainjobs.client import Client
from trainjobs.states import TERMINAL

SECRET = "e2e-secret-e2e-secret"
# Database workers: a test below kills the API while a job must still end (a joined worker records through it).
stack = module_stack("hooks", join=False, webhook_allow="127.0.0.1", webhook_backoff_s=0.2, webhook_backoff_max_s=0.5,
                     webhook_poll_s=0.1, webhook_timeout_s=2)


def tiny(**overrides) -> dict:
    return mlp_spec(**{"resources": {"nnodes": 1, "nproc_per_node": 1, "device": "cpu"},
                       "train": {"max_steps": 4, "log_every": 2, "seed": 0}, **overrides})


def events_of(receiver: Receiver, job_id: str) -> list[str]:
    """The events of the job the receiver answered with a 2xx, in arrival order."""
    return [r["json"]["event"] for r in receiver.delivered() if r["json"]["job"]["id"] == job_id]


def assert_each_event_once_and_signed(receiver: Receiver) -> None:
    delivered = receiver.delivered()
    ids = Counter(r["headers"]["X-Trainjobs-Event-Id"] for r in delivered)
    assert [i for i, n in ids.items() if n > 1] == [], "an event delivered twice"
    for r in delivered:
        assert signing.verify(SECRET, r["headers"], r["body"]), r["headers"]
        assert r["headers"]["X-Trainjobs-Event-Id"] == r["json"]["id"]


def test_a_receiver_gets_every_event_of_each_job_once_in_order_signed_with_the_job_as_get_shows_it(api):
    with Receiver() as receiver:
        hook = api.post("/v1/webhooks", json={"url": receiver.url, "secret": SECRET}).json()
        good = api.post("/v1/jobs", json=tiny(name="good")).json()["id"]
        bad = api.post("/v1/jobs", json=tiny(name="bad", fault_injection={"raise_at_step": 2, "rank": 0,
                                                                           "message": "boom on purpose"})).json()["id"]
        final = {job_id: wait_terminal(api, job_id, timeout=120) for job_id in (good, bad)}
        assert (final[good]["status"], final[bad]["status"]) == ("succeeded", "failed")
        wait_for(lambda: len(receiver.delivered()) >= 4, 30, what="four deliveries")
        assert events_of(receiver, good) == ["job.started", "job.succeeded"]
        assert events_of(receiver, bad) == ["job.started", "job.failed"]
        assert_each_event_once_and_signed(receiver)
        last = {r["json"]["job"]["id"]: r["json"]["job"] for r in receiver.delivered()}
        for job_id in (good, bad):
            shown = api.get(f"/v1/jobs/{job_id}").json()
            assert {k: v for k, v in last[job_id].items() if k != "pending_reason"} == {
                k: v for k, v in shown.items() if k != "pending_reason"}
        assert last[bad]["error"]["message"] == "boom on purpose"
        deliveries = api.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["data"]
        assert [d["status"] for d in deliveries] == ["delivered"] * 4
        api.delete(f"/v1/webhooks/{hook['id']}")


def test_a_receiver_down_then_up_gets_every_event_in_order_and_none_twice(api):
    with Receiver(status=500) as receiver:
        hook = api.post("/v1/webhooks", json={"url": receiver.url, "secret": SECRET}).json()
        job_id = api.post("/v1/jobs", json=tiny(name="while-down")).json()["id"]
        assert wait_terminal(api, job_id, timeout=120)["status"] == "succeeded"
        wait_for(lambda: len(receiver.requests) >= 4, 30, what="tries against the failing receiver")
        assert receiver.delivered() == []
        receiver.status = 200
        wait_for(lambda: events_of(receiver, job_id) == ["job.started", "job.succeeded"], 30,
                 what="both events after the receiver came back")
        assert_each_event_once_and_signed(receiver)
        # In order: nothing of job.succeeded was tried before job.started got its 2xx.
        tried = [(r["headers"]["X-Trainjobs-Event"], r["status"]) for r in receiver.requests]
        assert tried.index(("job.started", 200)) < min(i for i, t in enumerate(tried) if t[0] == "job.succeeded")
        started = api.get(f"/v1/webhooks/{hook['id']}/deliveries", params={"limit": 2}).json()["data"][-1]
        assert started["event"] == "job.started" and started["status"] == "delivered" and started["attempts"] >= 3
        assert [t["status_code"] for t in started["tries"]][-1] == 200
        assert set(t["status_code"] for t in started["tries"][:-1]) == {500}
        api.delete(f"/v1/webhooks/{hook['id']}")


def test_the_cli_creates_tests_shows_the_deliveries_of_and_deletes_a_webhook(stack, api, capsys):
    """The commands in this process (the parser, the SDK, the printing; no interpreter to start per call)."""

    def cli(*args: str) -> str:
        parsed = build_parser().parse_args(["webhooks", *args])
        with Client(stack.api_url, token=stack.token) as client:
            assert parsed.remote(parsed, client) == 0
        return capsys.readouterr().out

    with Receiver() as receiver:
        secret = cli("create", receiver.url, "--event", "job.failed", "--event", "job.hung").strip()
        (hook,) = api.get("/v1/webhooks").json()["data"]
        assert hook["events"] == ["job.failed", "job.hung"] and hook["secret_hint"] == f"...{secret[-4:]}"
        assert hook["id"] in cli("list")
        assert "delivered (200)" in cli("test", hook["id"])
        (request,) = receiver.requests
        assert signing.verify(secret, request["headers"], request["body"])
        (sent,) = json.loads(cli("deliveries", hook["id"], "--json"))["data"]
        assert (sent["event"], sent["status"], sent["last_status_code"]) == ("webhook.test", "delivered", 200)
        assert json.loads(cli("delete", hook["id"], "--json"))["id"] == hook["id"]
    assert api.get("/v1/webhooks").json()["count"] == 0


def job_status(url: str, job_id: str) -> str:
    engine = create_engine(url)
    with engine.connect() as conn:
        status = conn.scalar(select(Job.status).where(Job.id == job_id))
    engine.dispose()
    return status


def restart_api(stack) -> None:
    stack.procs = [(name, proc) for name, proc in stack.procs if name != "api"]
    stack._spawn("api", [sys.executable, "-m", "uvicorn", "service.api.asgi:app", "--host", stack.host,
                         "--port", str(stack.port), "--log-level", "warning"])
    stack._wait_ready(timeout=120)  # a busy machine starts an API slowly


def test_events_of_changes_made_just_before_the_api_was_killed_and_while_it_was_dead_still_arrive(stack, api):
    """The API's own change (a cancel), then SIGKILL at once; a worker's changes while no API runs: the outbox
    holds them all, and a new API delivers each once."""
    with Receiver(status=503) as receiver:
        api.post("/v1/webhooks", json={"url": receiver.url, "secret": SECRET})
        running = api.post("/v1/jobs", json=tiny(name="runs-while-api-dead", train={
            "max_steps": 30, "log_every": 5, "seed": 0})).json()["id"]
        stuck = api.post("/v1/jobs", json=tiny(name="fits-no-worker", resources={
            "nnodes": 1, "nproc_per_node": 1, "device": "cpu", "selector": {"zone": "nowhere"}}),
            params={"allow_unschedulable": "true"}).json()["id"]
        assert api.post(f"/v1/jobs/{stuck}/cancel").json()["status"] == "cancelled"
        dict(stack.procs)["api"].kill()  # SIGKILL, right after the cancel's commit
        dict(stack.procs)["api"].wait()
        receiver.status = 200
        wait_for(lambda: job_status(stack.settings.database_url, running) in TERMINAL, 120,
                 what="the job to end while no API runs")
        assert receiver.delivered() == []  # nobody delivered anything meanwhile
        restart_api(stack)
        wait_for(lambda: events_of(receiver, running) == ["job.started", "job.succeeded"]
                 and events_of(receiver, stuck) == ["job.cancelled"], 90, what="every event after the restart")
        assert_each_event_once_and_signed(receiver)
