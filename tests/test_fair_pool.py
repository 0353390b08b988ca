"""The fair pool on the real stack (issue 16): fair share, priority preemption, reservations for gangs, quotas,
and a queue each user can read. Tiny CPU jobs, short settings; two 1-slot workers in lanes a and b, so a test
that wants "the only worker" pins its jobs to lane a."""

import threading
import time
from datetime import datetime

import httpx
import pytest
from sqlalchemy import create_engine, select

from service.jobs.models import JobEvent
from tests.conftest import mlp_spec
from tests.helpers import module_stack, wait_for, wait_terminal

stack = module_stack("fair", workers=0, sweep_s=0.5, reconcile_s=1, preempt_after_s=1, min_runtime_s=1,
                     reserve_after_s=2, preempt_grace_s=30)


@pytest.fixture(scope="module", autouse=True)
def lanes(stack):
    """Two 1-slot workers, labelled lane=a and lane=b."""
    stack.add_workers(1, args=["--slots", "1", "--label", "lane=a"])
    stack.add_workers(1, args=["--slots", "1", "--label", "lane=b"])


def small(name: str, *, lane: str | None = "a", steps: int = 10, **extra) -> dict:
    resources = {"nproc_per_node": 1, "device": "cpu", **({"selector": {"lane": lane}} if lane else {})}
    return mlp_spec(name=name, resources=resources, train={"max_steps": steps, "log_every": 5, "seed": 0},
                    timeout_s=extra.pop("timeout_s", 120), **extra)


def user(stack, api, name: str, **fields) -> httpx.Client:
    secret = api.post("/v1/tokens", json={"name": name, **fields}).json()["token"]
    return httpx.Client(base_url=stack.api_url, timeout=10, headers={"Authorization": f"Bearer {secret}"})


def started(api, job_id: str) -> datetime | None:
    """When the job first left the queue (its first attempt's start)."""
    attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    return datetime.fromisoformat(attempts[0]["started_at"]) if attempts else None


def events(url: str, job_id: str) -> list[tuple[str, str | None]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(select(JobEvent.kind, JobEvent.detail).where(JobEvent.job_id == job_id)
                            .order_by(JobEvent.id)).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def cancel_all(api, ids) -> None:
    for job_id in ids:
        api.post(f"/v1/jobs/{job_id}/cancel")
    for job_id in ids:
        wait_terminal(api, job_id, timeout=60)


def test_a_light_user_goes_before_a_heavy_users_backlog(stack, api):
    alice, bob = user(stack, api, "alice-fair"), user(stack, api, "bob-fair")
    a = [alice.post("/v1/jobs", json=small(f"a{i}")).json()["id"] for i in range(6)]
    wait_for(lambda: alice.get(f"/v1/jobs/{a[0]}").json()["status"] in ("starting", "running", "succeeded"), 60,
             what="alice's first job to start")
    b = [bob.post("/v1/jobs", json=small(f"b{i}")).json()["id"] for i in range(2)]
    wait_for(lambda: started(api, b[0]) is not None, 120, what="bob's first job to start")
    assert started(api, a[2]) is None or started(api, b[0]) < started(api, a[2])
    cancel_all(api, a + b)


def test_a_high_job_preempts_a_low_one_which_resumes_from_its_checkpoint(stack, api, postgres_url):
    # 3 ms a step (a pinned 1-rank MLP steps in ~1 ms: it could end before the preemption reached it).
    low = api.post("/v1/jobs", json=small("low", steps=4000, priority="low", timeout_s=300,
                                          fault_injection={"sleep_per_step_s": 0.003, "rank": 0})).json()["id"]
    wait_for(lambda: (api.get(f"/v1/jobs/{low}").json()["progress"] or {}).get("step", 0) >= 50, 120,
             interval=0.1, what="the low job to train")
    high = api.post("/v1/jobs", json=small("high", priority="high")).json()["id"]
    job = wait_terminal(api, high, timeout=180)
    assert job["status"] == "succeeded", job["error"]
    first = api.get(f"/v1/jobs/{low}/attempts").json()["data"][0]
    assert first["status"] == "preempted"
    requeued = [d for k, d in events(postgres_url, low) if k == "queued"][1:]  # after its submission's
    assert len(requeued) == 1 and requeued[0].startswith(f"preempted by job {high} (priority high")
    detail = requeued[0]
    assert "handed back at step" in detail
    step = int(detail.split("handed back at step ")[1])
    assert started(api, high) > datetime.fromisoformat(first["started_at"])
    job = wait_terminal(api, low, timeout=240)
    assert job["status"] == "succeeded", job["error"]
    attempts = api.get(f"/v1/jobs/{low}/attempts").json()["data"]
    assert [(a["status"], a["resumed_from_step"]) for a in attempts] == [("preempted", None), ("succeeded", step)]
    assert job["summary"]["steps"] == 4000 and job["error"] is None  # no retry spent: not a failure


def test_a_two_node_job_starts_within_the_reservation_bound_behind_a_stream_of_one_node_jobs(stack, api):
    stop, stream = threading.Event(), []

    def feed():  # always two 1-node jobs waiting, on either worker, each ending well before its 30 s timeout
        with stack.client(timeout=10) as c:
            while not stop.is_set():
                waiting = sum(1 for j in stream if c.get(f"/v1/jobs/{j}").json()["status"] == "queued")
                if waiting < 2:
                    stream.append(c.post("/v1/jobs", json=small(f"s{len(stream)}", lane=None, steps=40,
                                                                timeout_s=30)).json()["id"])
                time.sleep(0.3)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        wait_for(lambda: len(stream) >= 4, 60, what="the stream to run")
        gang = mlp_spec(name="gang", resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"},
                        train={"max_steps": 10, "log_every": 5, "seed": 0}, timeout_s=120)
        submitted = time.monotonic()
        gang_id = api.post("/v1/jobs", json=gang).json()["id"]
        # The bound: reserve_after_s (2), then the reserved workers' running jobs end (timeout 30 s at most).
        wait_for(lambda: api.get(f"/v1/jobs/{gang_id}").json()["status"] != "queued", 2 + 30 + 15, interval=0.2,
                 what="the gang to start")
        waited = time.monotonic() - submitted
    finally:
        stop.set()
        feeder.join(timeout=30)
    job = wait_terminal(api, gang_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    assert waited < 2 + 30 + 15
    cancel_all(api, stream)


def test_a_team_over_its_slot_quota_waits_with_the_quota_as_its_reason(stack, api):
    assert api.put("/v1/teams/vision", json={"weight": 1, "max_slots": 1}).status_code == 200
    vera = user(stack, api, "vera", team="vision")
    # Both at once, to two free workers: each worker's plan may see the quota free, and the claim is the fence
    # (service/scheduling/quota.py): one runs, the other stays queued, whichever claimed first. Long enough to be
    # running while the sweeper writes the other's reason (cancelled below).
    ids = [vera.post("/v1/jobs", json=small(f"q{i}", lane=None, steps=200_000)).json()["id"] for i in (1, 2)]

    def one_runs_one_waits():
        jobs = [vera.get(f"/v1/jobs/{i}").json() for i in ids]
        running = [j for j in jobs if j["status"] in ("starting", "running")]
        waiting = [j for j in jobs if (j["pending_reason"] or "").startswith("over team quota")]
        assert len(running) <= 1, [(j["id"], j["status"]) for j in jobs]  # never both: the quota is 1 slot
        return (running[0], waiting[0]) if running and waiting and running[0]["status"] == "running" else None

    first, second = wait_for(one_runs_one_waits, 60, what="one running, the other waiting for the quota")
    assert second["status"] == "queued"  # a free worker fits it: only the quota holds it
    assert second["pending_reason"] == "over team quota vision: 1/1 slots in use, needs 1"
    assert [j["reason"] for j in vera.get("/v1/queue").json()["jobs"]] == [second["pending_reason"]]
    vera.post(f"/v1/jobs/{first['id']}/cancel")
    wait_for(lambda: vera.get(f"/v1/jobs/{second['id']}").json()["status"] == "running", 60, what="the other to run")
    vera.post(f"/v1/jobs/{second['id']}/cancel")
    job = wait_terminal(api, second["id"], timeout=120)
    assert job["status"] == "cancelled" and job["error"] is None  # it never failed: it waited, then ran


def test_the_queue_shows_a_user_their_own_positions_and_others_only_as_counts(stack, api):
    carol, dave = user(stack, api, "carol-q"), user(stack, api, "dave-q")
    nowhere = {"nproc_per_node": 1, "device": "cpu", "selector": {"lane": "z"}}  # no worker: they stay queued
    wait = {"allow_unschedulable": "true"}
    c = [carol.post("/v1/jobs", json=mlp_spec(name=f"c{i}", resources=nowhere), params=wait).json()["id"]
         for i in range(2)]
    d = [dave.post("/v1/jobs", json=mlp_spec(name=f"d{i}", resources=nowhere), params=wait).json()["id"]
         for i in range(3)]
    mine = carol.get("/v1/queue").json()
    assert [j["id"] for j in mine["jobs"]] == c and all(j["owner"] == "carol-q" for j in mine["jobs"])
    assert mine["others_waiting"] == 3 and mine["you"]["user"] == "carol-q"
    assert all(j["reason"].startswith("no live worker fits") for j in mine["jobs"])
    theirs = dave.get("/v1/queue").json()
    assert [j["id"] for j in theirs["jobs"]] == d and theirs["others_waiting"] == 2
    positions = [j["position"] for j in mine["jobs"]] + [j["position"] for j in theirs["jobs"]]
    assert sorted(positions) == [1, 2, 3, 4, 5]  # one order, seen in parts
    everyone = api.get("/v1/queue").json()  # an admin sees every job
    assert {j["id"] for j in everyone["jobs"]} == set(c + d)
    cancel_all(api, c + d)


def test_only_an_admin_may_opt_out_of_preemption(stack, api):
    erin = user(stack, api, "erin-q")
    r = erin.post("/v1/jobs", json=small("keep", preemptible=False))
    assert r.status_code == 403 and "preemptible" in r.text
    r = api.post("/v1/jobs", json=small("keep", lane="z", preemptible=False), params={"allow_unschedulable": "true"})
    assert r.status_code == 201
    cancel_all(api, [r.json()["id"]])
