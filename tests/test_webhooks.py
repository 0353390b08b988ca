"""Webhooks without a worker: the signature, the address policy, the outbox's order and compare-and-sets (both
databases), and the API's routes (owner isolation, the refused URL, the secret never shown back, a test send)."""

import hashlib
import hmac
import socket
import threading
import time
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import select, update

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle, records
from service.jobs import service as jobs
from service.settings import Settings
from service.webhooks import allow, delivery, outbox
from service.webhooks.models import Delivery, Webhook
from tests.conftest import QUEUE_PREFIX, REDIS_URL, mlp_spec
from tests.helpers import Receiver, wait_for
from tests.test_auth import make_token
from trainjobs import webhooks as signing
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus

SECRET = "s3cret-s3cret-s3cret"
NO_BACKOFF = outbox.Backoff(first_s=0.0, max_s=0.0, give_up_s=3600)


# --- the signature ---------------------------------------------------------------------------------------------

def test_the_signature_is_hmac_sha256_of_timestamp_dot_body_and_verify_checks_it():
    body, ts = b'{"event":"job.succeeded"}', 1_800_000_000
    expected = hmac.new(SECRET.encode(), b"1800000000." + body, hashlib.sha256).hexdigest()
    assert signing.sign(SECRET, ts, body) == f"sha256={expected}"
    headers = {"x-trainjobs-timestamp": str(ts), "X-Trainjobs-Signature": f"sha256={expected}"}
    assert signing.verify(SECRET, headers, body, now=ts + 10)
    assert not signing.verify(SECRET, headers, body + b" ", now=ts)  # another body
    assert not signing.verify("another-secret-entirely", headers, body, now=ts)
    assert not signing.verify(SECRET, headers, body, now=ts + 301)  # a replay, too late
    assert not signing.verify(SECRET, {}, body, now=ts)


# --- the address policy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8080/hook", "http://[::1]/hook", "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/hook", "http://192.168.0.10/hook", "http://0.0.0.0/hook", "http://[::ffff:127.0.0.1]/hook",
    "http://[fe80::1]/hook", "http://localhost:9/hook", "ftp://example.com/hook", "not a url", "http:///nohost",
])
def test_the_default_policy_refuses_loopback_link_local_private_metadata_and_non_http(url):
    with pytest.raises(allow.Refused) as refused:
        allow.check(url, "")
    assert refused.value.field == "url" and refused.value.status_code == 422


def test_the_allow_list_admits_the_networks_and_hosts_it_names_only():
    assert allow.check("https://93.184.216.34/hook", "").host == "93.184.216.34"  # public: always
    assert allow.check("http://127.0.0.1:9/hook", "127.0.0.1")
    with pytest.raises(allow.Refused):
        allow.check("http://127.0.0.2:9/hook", "127.0.0.1")
    assert allow.check("http://10.9.8.7/hook", "10.0.0.0/8, 192.168.0.0/16")
    policy = allow.policy_of("*.corp.example,hooks.internal")
    assert allow.resolve(httpx.URL("http://ci.corp.example/x"), policy) == []  # named: vouched for by the operator
    assert allow.resolve(httpx.URL("http://HOOKS.internal./x"), policy) == []
    with pytest.raises(allow.Refused):
        allow.check("http://169.254.169.254/", "127.0.0.1")


def test_a_host_that_rebinds_to_loopback_is_refused_at_delivery_and_nothing_is_sent(monkeypatch):
    with Receiver() as receiver:
        port = receiver.server.server_address[1]
        monkeypatch.setattr(socket, "getaddrinfo",
                            lambda host, *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))])
        hook = Webhook(id="wh_x", url=f"http://rebind.example:{port}/hook", secret=SECRET, format="json",
                       events=list(outbox.EVENTS))
        with httpx.Client() as client:
            outcome = delivery.send(client, hook, {"id": "evt_1", "event": "job.started"}, allow.policy_of(""))
        assert not outcome.ok and outcome.error.startswith("refused") and "127.0.0.1" in outcome.error
        assert receiver.requests == []


# --- the outbox, on both databases -----------------------------------------------------------------------------

@pytest.fixture
def sessions(db_url):
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def add_hook(sessions, *, owner: str = "admin", events=outbox.EVENTS, all_users: bool = False) -> str:
    with sessions() as db:
        hook = Webhook(id=f"wh_{owner}{len(events)}{int(all_users)}", owner=owner, url="http://127.0.0.1:9/",
                       events=list(events), format="json", secret=SECRET, all_users=all_users, created_at=utcnow())
        db.add(hook)
        db.commit()
        return hook.id


def run_job(sessions, owner: str = "admin") -> tuple[str, int]:
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            resources={"nnodes": 1, "nproc_per_node": 1, "device": "cpu"})), owner=owner).id
        db.commit()
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=30)
        db.commit()
        assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="launched")
        db.commit()
    return job_id, attempt


def end(sessions, job_id: str, attempt: int, status: JobStatus = JobStatus.CANCELLED) -> None:
    with sessions() as db:
        assert lifecycle.finish_node(db, job_id=job_id, attempt=attempt, node_rank=0, status=status, summary=None,
                                     error=None, exit_code=0)
        db.commit()


def rows(sessions, hook_id: str) -> list[Delivery]:
    with sessions() as db:
        return list(db.scalars(select(Delivery).where(Delivery.webhook_id == hook_id).order_by(Delivery.id)))


def test_each_state_change_writes_its_event_with_the_job_as_it_is_then_in_the_same_transaction(sessions):
    hook = add_hook(sessions)
    others = add_hook(sessions, owner="bob")
    everyone = add_hook(sessions, owner="root", all_users=True)
    only_failures = add_hook(sessions, events=("job.failed",))
    job_id, attempt = run_job(sessions)
    with sessions() as db:
        records.record_stacks(db, job_id=job_id, attempt=attempt, node_rank=0,
                              stacks={"reason": "hang", "message": "hung: rank 1 in all_reduce", "ranks": []})
        db.rollback()  # an event whose change is rolled back never leaves
        assert lifecycle.hand_back(db, job_id=job_id, attempt=attempt, detail="worker shutting down")
        db.commit()
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=30)
        assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="again")
        records.record_stacks(db, job_id=job_id, attempt=attempt, node_rank=0,
                              stacks={"reason": "hang", "message": "hung: rank 1 in all_reduce", "ranks": []})
        assert lifecycle.finish_node(db, job_id=job_id, attempt=attempt, node_rank=0, status=JobStatus.SUCCEEDED,
                                     summary={"steps": 20}, error=None, exit_code=0)
        db.commit()
    got = rows(sessions, hook)
    assert [r.event for r in got] == ["job.started", "job.preempted", "job.started", "job.hung", "job.succeeded"]
    assert [r.payload["job"]["status"] for r in got] == ["running", "queued", "running", "running", "succeeded"]
    assert got[-1].payload["job"]["summary"] == {"steps": 20} and got[-1].payload["job"]["id"] == job_id
    assert {r.subject for r in got} == {f"job/{job_id}"} and len({r.event_id for r in got}) == 5
    assert all(r.payload["id"] == r.event_id and r.payload["event"] == r.event for r in got)
    assert rows(sessions, others) == [] and rows(sessions, only_failures) == []
    assert [r.event_id for r in rows(sessions, everyone)] == [r.event_id for r in got]  # same event, same id


def test_only_the_first_pending_row_of_a_subject_is_due_and_a_claim_has_one_winner(sessions):
    hook = add_hook(sessions)
    first_job, attempt = run_job(sessions)
    run_job(sessions)
    end(sessions, first_job, attempt)
    a_started, b_started, a_cancelled = (r.id for r in rows(sessions, hook))
    with sessions() as db:
        assert outbox.due(db, limit=10) == [a_started, b_started]  # a_cancelled waits for a_started
        first = outbox.claim(db, delivery_id=a_started, by="api-1", hold_s=30)
        assert first is not None and outbox.claim(db, delivery_id=a_started, by="api-2", hold_s=30) is None
        assert outbox.due(db, limit=10) == [b_started]  # claimed rows are not due; the next still waits
        # A failed try: scheduled again, and the job's next event keeps waiting behind it.
        failed = outbox.Outcome(status_code=500, response="down")
        assert outbox.settle(db, claimed=first, by="api-1", outcome=failed, backoff=NO_BACKOFF) == "pending"
        assert outbox.settle(db, claimed=first, by="api-1", outcome=failed, backoff=NO_BACKOFF) is None  # settled
        assert outbox.due(db, limit=10) == [a_started, b_started]
        again = outbox.claim(db, delivery_id=a_started, by="api-2", hold_s=30)
        assert outbox.settle(db, claimed=again, by="api-2", outcome=outbox.Outcome(status_code=204),
                             backoff=NO_BACKOFF) == "delivered"
        assert outbox.due(db, limit=10) == [b_started, a_cancelled]
    row = rows(sessions, hook)[0]
    assert (row.status, row.attempts, row.last_status_code) == ("delivered", 2, 204)
    assert [t["status_code"] for t in row.tries] == [500, 204]


def test_a_claim_whose_holder_died_lapses_and_a_row_failing_past_the_give_up_time_is_given_up(sessions):
    hook = add_hook(sessions)
    job_id, attempt = run_job(sessions)
    end(sessions, job_id, attempt)
    started, cancelled = (r.id for r in rows(sessions, hook))
    with sessions() as db:
        assert outbox.claim(db, delivery_id=started, by="dead", hold_s=30) is not None
        db.execute(update(Delivery).where(Delivery.id == started).values(claimed_until=utcnow() - timedelta(seconds=1)))
        db.commit()
        taken = outbox.claim(db, delivery_id=started, by="alive", hold_s=30)
        assert taken is not None
        assert outbox.settle(db, claimed=taken, by="dead", outcome=outbox.Outcome(status_code=200),
                             backoff=NO_BACKOFF) is None  # the dead holder's late answer changes nothing
        expired = outbox.Backoff(first_s=1, max_s=1, give_up_s=0)
        assert outbox.settle(db, claimed=taken, by="alive", outcome=outbox.Outcome(error="ConnectError: refused"),
                             backoff=expired) == "given_up"
        assert outbox.due(db, limit=10) == [cancelled]  # given up: the next event goes on


def test_the_backoff_doubles_from_the_first_wait_up_to_the_cap():
    backoff = outbox.Backoff(first_s=5, max_s=3600, give_up_s=86400)
    assert [backoff.wait_s(n) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert backoff.wait_s(11) == 3600 and backoff.wait_s(10_000) == 3600


def test_prune_deletes_settled_rows_older_than_the_cutoff_only(sessions):
    hook = add_hook(sessions)
    job_id, attempt = run_job(sessions)
    end(sessions, job_id, attempt)
    started, cancelled = (r.id for r in rows(sessions, hook))
    with sessions() as db:
        db.execute(update(Delivery).where(Delivery.id == started).values(status="delivered"))
        db.commit()
        assert outbox.prune(db, before=utcnow() - timedelta(days=1)) == 0
        assert outbox.prune(db, before=utcnow() + timedelta(seconds=1)) == 1
    assert [r.id for r in rows(sessions, hook)] == [cancelled]  # pending rows are never pruned


# --- the API ---------------------------------------------------------------------------------------------------

@pytest.fixture
def settings(db_url, tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=db_url, redis_url=REDIS_URL, queue_prefix=QUEUE_PREFIX,
                    reconcile_s=3600, webhook_allow="127.0.0.1", webhook_timeout_s=2)


def test_a_url_the_policy_refuses_is_a_422_naming_url(client):
    for url in ("http://169.254.169.254/latest/", "http://10.0.0.5/hook", "http://[::1]:9/", "gopher://x/"):
        r = client.post("/v1/webhooks", json={"url": url})
        assert (r.status_code, r.json()["field"]) == (422, "url"), (url, r.text)
    assert client.get("/v1/webhooks").json() == {"items": [], "data": [], "count": 0}


def test_another_user_can_neither_see_nor_test_nor_delete_a_webhook(client, settings):
    alice = {"Authorization": f"Bearer {make_token(settings, 'alice')}"}
    bob = {"Authorization": f"Bearer {make_token(settings, 'bob')}"}
    with Receiver() as receiver:
        made = client.post("/v1/webhooks", json={"url": receiver.url, "events": ["job.failed"], "secret": SECRET},
                           headers=alice)
        assert made.status_code == 201 and made.json()["secret"] == SECRET
        hook = made.json()
        assert hook["owner"] == "alice" and hook["secret_hint"] == f"...{SECRET[-4:]}"
        shown = client.get(f"/v1/webhooks/{hook['id']}", headers=alice).json()
        assert "secret" not in shown and SECRET not in str(shown)
        assert client.get("/v1/webhooks", headers=bob).json()["count"] == 0
        assert client.get("/v1/webhooks", params={"owner": "alice"}, headers=bob).json()["count"] == 0
        for method, suffix in (("GET", ""), ("GET", "/deliveries"), ("POST", "/test"), ("DELETE", "")):
            r = client.request(method, f"/v1/webhooks/{hook['id']}{suffix}", headers=bob)
            unknown = client.request(method, f"/v1/webhooks/wh_0000000000000000{suffix}", headers=bob)
            assert r.status_code == unknown.status_code == 404, (method, suffix)
            assert r.json()["detail"].replace(hook["id"], "wh_0000000000000000") == unknown.json()["detail"]
        assert receiver.requests == []  # bob's test sent nothing
        assert client.get(f"/v1/webhooks/{hook['id']}", headers=alice).status_code == 200
        assert client.get("/v1/webhooks", params={"owner": "alice"}).json()["count"] == 1  # an admin may look
        r = client.post("/v1/webhooks", json={"url": receiver.url, "all_users": True}, headers=alice)
        assert (r.status_code, r.json()["field"]) == (403, "all_users")
        assert client.delete(f"/v1/webhooks/{hook['id']}", headers=alice).status_code == 200
        assert client.get(f"/v1/webhooks/{hook['id']}", headers=alice).status_code == 404


def test_the_test_route_sends_one_signed_event_and_shows_it_in_the_deliveries(client):
    with Receiver() as receiver:
        hook = client.post("/v1/webhooks", json={"url": receiver.url}).json()
        assert hook["secret"].startswith("whsec_") and hook["events"] == list(outbox.EVENTS)
        sent = client.post(f"/v1/webhooks/{hook['id']}/test").json()
        assert (sent["status"], sent["attempts"], sent["last_status_code"], sent["last_response"]) == (
            "delivered", 1, 200, "ok")
        (request,) = receiver.requests
        assert signing.verify(hook["secret"], request["headers"], request["body"])
        assert request["headers"]["X-Trainjobs-Event-Id"] == sent["event_id"]
        listed = client.get(f"/v1/webhooks/{hook['id']}/deliveries").json()
        assert [d["event_id"] for d in listed["data"]] == [sent["event_id"]]
        receiver.status = 500
        failed = client.post(f"/v1/webhooks/{hook['id']}/test").json()
        assert (failed["status"], failed["last_status_code"], failed["next_attempt_at"]) == ("given_up", 500, None)
        slack = client.post("/v1/webhooks", json={"url": receiver.url, "format": "slack"}).json()
        receiver.status = 200
        client.post(f"/v1/webhooks/{slack['id']}/test")
        assert set(receiver.delivered()[-1]["json"]) == {"text"}
    time.sleep(0)  # the receiver is closed; nothing more is sent to it


def test_metrics_show_the_webhook_backlog_and_its_oldest_event(client, sessions):
    hook = add_hook(sessions)
    with sessions() as db:  # an event of an hour ago, its receiver down since
        db.add(Delivery(webhook_id=hook, event_id="evt_old", event="job.failed", subject="job/x", payload={},
                        status="pending", attempts=9, created_at=utcnow() - timedelta(hours=1),
                        next_attempt_at=utcnow() + timedelta(hours=1)))
        db.commit()
    text = client.get("/metrics").text
    assert "trainjobs_webhook_deliveries_pending 1.0" in text
    (age,) = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("trainjobs_webhook_oldest_pending_seconds ")]
    assert 3590 < age < 3700


def test_two_delivery_loops_on_one_outbox_send_each_event_once_and_each_subject_in_order(sessions, tmp_path):
    """Two API processes' loops (two Deliverers, each its own claims) racing over 3 subjects × 6 events."""
    with Receiver() as receiver:
        with sessions() as db:
            hook = Webhook(id="wh_race", owner="admin", url=receiver.url, events=list(outbox.EVENTS), format="json",
                           secret=SECRET, all_users=False, created_at=utcnow())
            db.add(hook)
            db.commit()
            for n in range(6):
                for subject in ("a", "b", "c"):
                    outbox.emit(db, event="job.started", subject=f"job/{subject}", owner="admin",
                                data=lambda s=subject, n=n: {"job": {"id": s, "n": n}})
            db.commit()
        conf = Settings(data_dir=tmp_path, webhook_allow="127.0.0.1", webhook_poll_s=0.05, webhook_concurrency=4,
                        webhook_backoff_s=0.05, webhook_backoff_max_s=0.05)
        loops = [delivery.Deliverer(conf, sessions) for _ in range(2)]
        threads = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(receiver.delivered()) >= 18, 60, what="18 deliveries")
        finally:
            for loop in loops:
                loop.stop.set()
                loop.wake.set()
            for t in threads:
                t.join(10)
        got = receiver.delivered()
        assert len(got) == 18 and len({r["json"]["id"] for r in got}) == 18  # none twice
        for subject in ("a", "b", "c"):
            assert [r["json"]["job"]["n"] for r in got if r["json"]["job"]["id"] == subject] == list(range(6))
        assert {r.status for r in rows(sessions, "wh_race")} == {"delivered"}
