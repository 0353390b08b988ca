"""Workers in the database and capacity-aware dispatch, end to end: real API, real workers, PostgreSQL, Redis.

Workers register with what they offer (here overridden with --slots/--label), heartbeat, and show in
GET /v1/workers. A job no live worker can fit stays queued, on its queue, with a pending_reason, and no
worker claims it; a worker that fits arrives and runs it.
"""

import signal
import time

from tests.conftest import mlp_spec
from tests.helpers import module_stack, wait_for, wait_terminal

LEASE_S = 3.0
FIELDS = {"id", "host", "address", "device", "slots", "busy_slots", "memory_gb", "labels", "state", "pressure",
          "current_job", "max_jobs", "jobs", "devices", "last_seen"}


stack = module_stack("workers", workers=0, lease_s=LEASE_S, heartbeat_s=0.5, sweep_s=0.5)


def workers_by_id(api) -> dict[str, dict]:
    body = api.get("/v1/workers").json()
    assert set(body) == {"items", "next_cursor"}
    return {w["id"]: w for w in body["items"]}


def test_workers_register_with_their_flags_and_show_in_the_list(stack, api):
    procs = stack.add_workers(2, args=["--slots", "1", "--device", "cpu", "--label", "zone=a"])
    listed = wait_for(lambda: (w := workers_by_id(api)) and len(w) == 2 and w, 30, what="two workers")
    for worker in listed.values():
        assert set(worker) == FIELDS
        assert worker["slots"] == 1 and worker["busy_slots"] == 0 and worker["device"] == "cpu"
        own = {k: v for k, v in worker["labels"].items() if not k.startswith("trainjobs.io/")}  # what it enforces
        assert own == {"zone": "a"} and worker["state"] == "idle" and worker["current_job"] is None
        assert worker["labels"]["trainjobs.io/sandbox"] in ("on", "off")
        assert worker["memory_gb"] > 0 and worker["address"] and worker["host"]
    assert {int(i.rsplit("-", 1)[1]) for i in listed} == {p.pid for p in procs}


def test_a_job_no_live_worker_fits_waits_with_a_reason_until_one_that_fits_arrives(stack, api):
    spec = mlp_spec(name="four-slots", resources={"nproc_per_node": 4, "device": "cpu"},
                    train={"max_steps": 10, "log_every": 5, "seed": 0})
    job_id = api.post("/v1/jobs", json=spec, params={"allow_unschedulable": "true"}).json()["id"]
    job = wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["pending_reason"] and j, 15,
                   what="a pending_reason")
    assert job["status"] == "queued" and "no live worker fits" in job["pending_reason"]
    assert "1 slot(s), needs 4" in job["pending_reason"]
    small = mlp_spec(name="one-slot", resources={"nproc_per_node": 1, "device": "cpu"})  # it runs past the big one
    small_id = api.post("/v1/jobs", json=small).json()["id"]
    assert wait_terminal(api, small_id, timeout=60)["status"] == "succeeded"
    time.sleep(2 * LEASE_S)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["attempt"] == 0 and job["pending_reason"]
    assert api.get(f"/v1/jobs/{job_id}/attempts").json()["count"] == 0  # no worker claimed it, none bounced it

    (big,) = stack.add_workers(1, args=["--slots", "4"])
    busy = wait_for(lambda: (w := workers_by_id(api).get(f"{socket_host(api)}-{big.pid}")) and w["state"] == "busy"
                    and w, 60, interval=0.1, what="the 4-slot worker to take the job")
    assert busy["current_job"] == job_id and busy["busy_slots"] == 4 and busy["slots"] == 4
    job = wait_terminal(api, job_id, timeout=90)
    assert job["status"] == "succeeded", job["error"]
    assert job["pending_reason"] is None
    (attempt,) = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    assert attempt["worker"].endswith(f"-{big.pid}")
    assert workers_by_id(api)[attempt["worker"]]["state"] == "idle"


def test_a_worker_killed_shows_as_lost_and_one_stopped_cleanly_leaves_the_list(stack, api):
    killed, stopped = stack.add_workers(2, args=["--slots", "1", "--label", "zone=b"])
    def registered() -> list[str] | None:
        listed = workers_by_id(api)
        names = [next((i for i in listed if i.endswith(f"-{p.pid}")), None) for p in (killed, stopped)]
        return names if all(names) else None

    names = wait_for(registered, 30, what="the workers to register")
    killed.kill()
    assert workers_by_id(api)[names[0]]["state"] != "lost"  # not yet: within its lease
    # NOTE: checked before the other worker's stop, which may take longer than the lease on a busy machine.
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(15) == 0
    assert names[1] not in workers_by_id(api)
    wait_for(lambda: workers_by_id(api)[names[0]]["state"] == "lost", LEASE_S + 5, what="the worker to show as lost")


def socket_host(api) -> str:
    """The host part of the workers' names (they run here)."""
    return next(iter(workers_by_id(api))).rsplit("-", 1)[0]
