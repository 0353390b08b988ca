"""Shared workers (issue 30), end to end: real API, real workers of 2 CPU slots that run 2 jobs at once, real
torchrun, PostgreSQL, Redis. Each job gets slots of its own (its ranks pinned to their cores, read from /proc),
its own lease and cancel; a job that needs 2 slots waits for one worker with 2 free rather than spanning two;
kill -9 a worker and both its jobs run again on the other.
"""

import os
import signal
import time
from datetime import timedelta

import psutil
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, select
from sqlalchemy.orm import sessionmaker

from service.db import utcnow
from service.jobs.models import Attempt
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Hold, Worker
from tests.conftest import mlp_spec
from tests.helpers import module_stack, processes_of, wait_for, wait_terminal

LEASE_S = 4.0
stack = module_stack("shared", workers=2, worker_slots=2, worker_max_jobs=2, lease_s=LEASE_S, heartbeat_s=0.5,
                     sweep_s=0.5)


def one_slot(name: str, steps: int, sleep_s: float = 0.0, **overrides) -> dict:
    """A 1-rank job; `sleep_s` per step makes it last (steps × sleep_s) without using its core."""
    extra = {"fault_injection": {"sleep_per_step_s": sleep_s, "rank": 0}} if sleep_s else {}
    return mlp_spec(name=name, resources={"nnodes": 1, "nproc_per_node": 1, "device": "cpu"},
                    train={"max_steps": steps, "log_every": 10, "seed": 0}, **extra, **overrides)


def attempts(url: str, job_id: str) -> list[Attempt]:
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            return list(db.execute(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)).all())
    finally:
        engine.dispose()


def running(api, job_id: str) -> dict:
    return wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running" and j["progress"]
                    and j["progress"].get("step", 0) >= 1 and j, 90, what=f"job {job_id} running")


def allowed_cores(job_id: str) -> set[str]:
    """The Cpus_allowed_list of every live process of the job (its torchrun and ranks)."""
    found = set()
    for proc in processes_of(job_id):
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                found |= {line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list")}
        except OSError:
            pass
    return found


def test_two_one_slot_jobs_run_at_once_on_one_worker_on_disjoint_cores_and_the_job_shows_where(api, stack,
                                                                                              postgres_url):
    a = api.post("/v1/jobs", json=one_slot("a", 80, 0.05)).json()["id"]
    b = api.post("/v1/jobs", json=one_slot("b", 80, 0.05)).json()["id"]
    running(api, a), running(api, b)
    placed = [api.get(f"/v1/jobs/{j}").json()["placement"] for j in (a, b)]
    assert placed[0][0]["worker"] == placed[1][0]["worker"], placed  # best fit: both on one worker
    cores_a, cores_b = allowed_cores(a), allowed_cores(b)
    assert len(cores_a) == len(cores_b) == 1 and cores_a != cores_b, (cores_a, cores_b)  # one core each, not shared

    workers = {w["id"]: w for w in api.get("/v1/workers").json()["items"]}
    scraped = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for f in text_string_to_metric_families(api.get("/metrics").text) for m in f.samples}
    assert scraped[("trainjobs_worker_devices", (("device", "cpu"), ("state", "held")))] == 2
    assert scraped[("trainjobs_worker_devices", (("device", "cpu"), ("state", "free")))] == 2  # the other worker's
    assert scraped[("trainjobs_worker_slots_free", (("device", "cpu"),))] == 2
    shared = [w for w in workers.values() if w["busy_slots"] == 2]  # best fit: both on one worker
    assert len(shared) == 1, [(w["id"], w["busy_slots"], w["devices"], w["jobs"]) for w in workers.values()]
    [shared] = shared
    assert sorted(d["job"] for d in shared["devices"]) == sorted([a, b]), shared["devices"]
    job = api.get(f"/v1/jobs/{a}").json()
    [where] = job["placement"]
    assert where["worker"] == shared["id"] and len(where["devices"]) == 1 and where["cores"] == [int(c) for c in
                                                                                                cores_a.pop().split(",")]
    done_a, done_b = wait_terminal(api, a), wait_terminal(api, b)
    assert done_a["status"] == done_b["status"] == "succeeded"
    [att_a], [att_b] = attempts(postgres_url, a), attempts(postgres_url, b)
    assert att_a.started_at < att_b.finished_at and att_b.started_at < att_a.finished_at  # at the same time
    log = api.get(f"/v1/jobs/{a}/logs").text
    assert f"[trainjobs] attempt 1 on {shared['id']}: slot(s) {where['devices'][0]}, cores " in log, log[:500]


def test_cancelling_one_job_leaves_its_neighbour_running_to_the_same_losses_as_alone(api, stack):
    spec = one_slot("steady", 300)
    alone = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"])
    assert alone["status"] == "succeeded", alone["error"]

    neighbour = api.post("/v1/jobs", json=one_slot("doomed", 2000, 0.05)).json()["id"]
    running(api, neighbour)
    steady = api.post("/v1/jobs", json=spec).json()["id"]
    running(api, steady)
    assert api.post(f"/v1/jobs/{neighbour}/cancel").status_code == 200
    cancelled, shared = wait_terminal(api, neighbour), wait_terminal(api, steady)
    assert cancelled["status"] == "cancelled" and shared["status"] == "succeeded", shared["error"]
    assert shared["placement"][0]["worker"] == api.get(f"/v1/jobs/{neighbour}").json()["placement"][0]["worker"]
    assert shared["summary"]["final_loss"] == alone["summary"]["final_loss"]


def test_a_two_slot_job_waits_for_one_worker_with_two_free_slots_rather_than_spanning_two(api, stack, postgres_url):
    # Three 1-slot jobs: two fill one worker, the third takes one slot of the other. 2 slots are free in the pool,
    # but on two workers: the 2-slot job waits, and says so in slots.
    fillers = [api.post("/v1/jobs", json=one_slot(f"fill{i}", 60 if i < 2 else 200, 0.05)).json()["id"]
               for i in range(3)]
    for f in fillers:
        running(api, f)
    pair = api.post("/v1/jobs", json=mlp_spec(name="pair", train={"max_steps": 20, "log_every": 5, "seed": 0}))
    pair = pair.json()["id"]
    reason = wait_for(lambda: api.get(f"/v1/jobs/{pair}").json().get("pending_reason"), 30, what="a pending reason")
    assert "needs 2 CPU slots on one node; the largest free set is 1" in reason, reason
    done = wait_terminal(api, pair)
    assert done["status"] == "succeeded", done["error"]
    [where] = done["placement"]
    assert len(where["devices"]) == 2
    ended = [wait_terminal(api, f) for f in fillers]
    [att] = attempts(postgres_url, pair)
    on_its_worker = [f for f, e in zip(fillers, ended, strict=True) if e["placement"][0]["worker"] == where["worker"]]
    for f in on_its_worker:  # it started once its worker's fillers ended, never beside them
        assert attempts(postgres_url, f)[-1].finished_at <= att.started_at


def test_a_gang_node_shares_a_worker_with_another_job_and_both_finish(api, stack):
    beside = api.post("/v1/jobs", json=one_slot("beside", 200, 0.05)).json()["id"]
    running(api, beside)
    gang = api.post("/v1/jobs", json=mlp_spec(name="gang", resources={"nnodes": 2, "nproc_per_node": 1,
                                                                       "device": "cpu"},
                                              train={"max_steps": 40, "log_every": 10, "seed": 0})).json()["id"]
    done = wait_terminal(api, gang, timeout=150)
    assert done["status"] == "succeeded", done["error"]
    nodes = {p["node_rank"]: p for p in done["placement"]}
    assert sorted(nodes) == [0, 1] and nodes[0]["worker"] != nodes[1]["worker"]  # one node per worker
    where = api.get(f"/v1/jobs/{beside}").json()["placement"][0]
    [shared] = [n for n in nodes.values() if n["worker"] == where["worker"]]  # one node beside the other job
    assert set(shared["devices"]).isdisjoint(where["devices"])
    assert wait_terminal(api, beside)["status"] == "succeeded"


def test_two_jobs_never_hold_one_device_and_a_restart_keeps_only_live_holds(postgres_url):
    engine = create_engine(postgres_url)
    sessions = sessionmaker(engine)
    try:
        with sessions() as db:
            assert holds.take(db, worker_id="w-race", job_id="j1", node_rank=0, devices=[0, 1])
        with sessions() as db:
            assert not holds.take(db, worker_id="w-race", job_id="j2", node_rank=0, devices=[1])
            assert holds.take(db, worker_id="w-race", job_id="j2", node_rank=0, devices=[2])
            assert holds.held(db, worker_id="w-race") == {0: ("j1", 0), 1: ("j1", 0), 2: ("j2", 0)}
            # j1's claim never came (pending, taken long ago): stale, swept; j2's stays.
            db.execute(Hold.__table__.update().where(Hold.job_id == "j1").values(since=utcnow() - timedelta(hours=1)))
            db.commit()
            assert holds.sweep(db, worker_id="w-race") == 2
            db.commit()
            assert holds.held(db, worker_id="w-race") == {2: ("j2", 0)}
            holds.release(db, worker_id="w-race", job_id="j2")
            db.commit()
    finally:
        engine.dispose()


def test_a_claim_after_its_devices_were_taken_counts_them_once(postgres_url):
    """The worker's row says 2 busy slots of a job holding 2 devices from its claim on, not 4 until the bind:
    `trainjobs workers` and the dashboard read busy_slots in that window too."""
    engine = create_engine(postgres_url)
    sessions = sessionmaker(engine)
    try:
        with sessions() as db:
            workers.register(db, worker_id="w-once", host="h", address="127.0.0.1", device="cpu", slots=4,
                             memory_bytes=None, host_memory_bytes=None, labels={}, max_jobs=2)
            db.commit()
            assert holds.take(db, worker_id="w-once", job_id="j-once", node_rank=0, devices=[0, 1])
            workers.occupy(db, worker_id="w-once", job_id="j-once", slots=2)  # the claim's transaction
            db.commit()
            row = db.get(Worker, "w-once")
            assert (row.busy_slots, row.current_job, row.state) == (2, "j-once", "busy")
            holds.release(db, worker_id="w-once", job_id="j-once")
            db.execute(Worker.__table__.delete().where(Worker.id == "w-once"))
            db.commit()
    finally:
        engine.dispose()


def test_kill_9_of_a_shared_worker_sends_both_its_jobs_to_the_other(api, stack, postgres_url):
    jobs = [api.post("/v1/jobs", json=one_slot(f"k{i}", 120, 0.05, max_retries=1)).json()["id"] for i in range(2)]
    for j in jobs:
        running(api, j)
    placed = {api.get(f"/v1/jobs/{j}").json()["placement"][0]["worker"] for j in jobs}
    assert len(placed) == 1, placed  # packed on one worker
    victim = placed.pop()
    [row] = [w for w in api.get("/v1/workers").json()["items"] if w["id"] == victim]
    pid = int(victim.rpartition("-")[2])
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in tree:  # the machine gone: the worker, its lanes, their work-horses, torchrun and the ranks
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    started = time.monotonic()
    for j in jobs:
        done = wait_terminal(api, j, timeout=180)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempt"] == 2 and done["placement"][0]["worker"] != victim
    assert time.monotonic() - started < 150
    assert row["max_jobs"] == 2
    assert not any(processes_of(j) for j in jobs)
    assert os.path.exists("/proc") and all(not psutil.pid_exists(p.pid) or p.status() == psutil.STATUS_ZOMBIE
                                           for p in tree)


def test_a_draining_shared_worker_hands_every_job_back_and_the_other_runs_them(api, stack, postgres_url):
    # After the kill above one worker is left: a second joins, and the two jobs pack onto one of them.
    [fresh] = stack.add_workers(1)
    wait_for(lambda: len(api.get("/v1/workers").json()["items"]) >= 2 and all(
        w["state"] != "lost" for w in api.get("/v1/workers").json()["items"] if w["id"] == f"vm-{fresh.pid}"),
        30, what="the new worker")
    jobs = [api.post("/v1/jobs", json=one_slot(f"d{i}", 100, 0.05)).json()["id"] for i in range(2)]
    for j in jobs:
        running(api, j)
    [draining] = {api.get(f"/v1/jobs/{j}").json()["placement"][0]["worker"] for j in jobs}
    os.kill(int(draining.rpartition("-")[2]), signal.SIGTERM)  # a warm shutdown: every lane hands its job back
    for j in jobs:
        done = wait_terminal(api, j, timeout=150)
        assert done["status"] == "succeeded", done["error"]
        assert done["placement"][0]["worker"] != draining and done["attempt"] == 2
    for j in jobs:  # handed back, not failed: no retry spent
        assert [a.status for a in attempts(postgres_url, j)] == ["preempted", "succeeded"]
