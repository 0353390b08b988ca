"""Multi-node jobs on one machine: two (or three) 1-slot workers, each one node of a gang, c10d rendezvous, gloo.

The gang's losses equal a 1-node 2-process run of the same spec; each node shows in the attempts and has its
own log. A worker killed mid-run stops the whole gang on the other node too, and the job is retried as one.
"""

import signal
import time

import psutil
import pytest
from sqlalchemy import create_engine, select

from service.jobs.models import JobEvent
from service.settings import Settings
from tests.conftest import mlp_spec
from tests.helpers import module_stack, processes_of, run_torchrun, wait_for, wait_terminal
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker.launch import Gang
from worker.supervisor import Supervisor

LEASE_S = 4.0
GANG_TIMEOUT_S = 8.0


stack = module_stack("gang", workers=2, worker_args=["--slots", "1"], lease_s=LEASE_S, heartbeat_s=0.5,
                     sweep_s=0.5, gang_timeout_s=GANG_TIMEOUT_S)


@pytest.fixture
def api(stack):
    with stack.client(timeout=10) as client:
        wait_for(lambda: sum(w["state"] != "lost" for w in client.get("/v1/workers").json()["items"]) >= 2, 30,
                 what="two live workers")
        yield client


def two_node(**overrides) -> dict:
    return mlp_spec(resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"}, **overrides)


def attempts(api, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]


def test_a_two_node_job_matches_one_node_with_two_processes(stack, api, tmp_path, postgres_url):
    spec = two_node(name="gang-2x1", train={"max_steps": 20, "log_every": 5, "seed": 0})
    started = time.monotonic()
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    print(f"2-node job submitted to succeeded in {time.monotonic() - started:.1f}s")
    nodes = attempts(api, job_id)
    assert sorted(a["node_rank"] for a in nodes) == [0, 1] and {a["status"] for a in nodes} == {"succeeded"}
    assert nodes[0]["worker"] != nodes[1]["worker"] and {a["number"] for a in nodes} == {1}

    gang_loss = api.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"][0]
    single = {**spec, "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"}}
    records = [r for r in run_torchrun(single, tmp_path / "single") if r["type"] == "metrics"]
    assert gang_loss["steps"] == [r["step"] for r in records] == [5, 10, 15, 20]
    assert gang_loss["values"] == pytest.approx([r["metrics"]["loss"] for r in records], abs=1e-5)
    assert job["summary"]["final_loss"] == pytest.approx(records[-1]["metrics"]["loss"], abs=1e-5)

    # Each node's local rank 0 keeps its own series: the all-reduced loss is the same, the step time its own.
    per_node = {rank: {s["name"]: s for s in api.get(f"/v1/jobs/{job_id}/metrics",
                                                      params={"node_rank": rank}).json()["series"]}
                for rank in (0, 1)}
    assert per_node[1]["loss"]["steps"] == [5, 10, 15, 20]
    assert per_node[1]["loss"]["values"] == pytest.approx(per_node[0]["loss"]["values"], abs=1e-6)
    assert {"peak_mem_mb", "step_time_s", "samples_per_s"} <= per_node[1].keys()

    logs = {rank: api.get(f"/v1/jobs/{job_id}/logs", params={"node_rank": rank}).text for rank in (0, 1)}
    assert all(logs.values()) and logs[0] != logs[1]  # each node's own torchrun output
    assert api.get(f"/v1/jobs/{job_id}/logs", params={"node_rank": 2}).text == ""
    formed = formation(postgres_url, job_id)
    assert formed is not None and "rendezvous at 127.0.0.1:" in formed
    print(f"events: {formed}")


def formation(url: str, job_id: str) -> str | None:
    """The job event that says how long the gang took to form, and where its rendezvous is."""
    engine = create_engine(url)
    with engine.connect() as conn:
        detail = conn.scalar(select(JobEvent.detail).where(JobEvent.job_id == job_id, JobEvent.kind == "running")
                             .order_by(JobEvent.id.desc()))
    engine.dispose()
    return detail


def test_a_killed_node_stops_the_whole_gang_and_the_job_is_retried_as_one(stack, api):
    spec = two_node(name="gang-kill", max_retries=2,  # 2: a busy CI box can lose a lease once on its own
                    data={"type": "synthetic_regression", "num_samples": 4096, "batch_size": 16},
                    train={"max_steps": 3000, "log_every": 100, "checkpoint_every": 500})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running"
             and j["progress"]["step"] >= 700, 120, what="the gang to train past a checkpoint")
    current = max(a["number"] for a in attempts(api, job_id))
    first = {a["node_rank"]: a for a in attempts(api, job_id) if a["number"] == current}
    victim_pid = int(first[1]["worker"].rsplit("-", 1)[1])
    victim = psutil.Process(victim_pid)
    survivors = [p for p in processes_of(job_id) if p.pid not in {c.pid for c in victim.children(recursive=True)}]
    assert survivors, "node 0's processes"
    for proc in [victim, *victim.children()]:  # the worker and its work-horse: the machine is gone
        proc.kill()
    killed = time.monotonic()
    stack.add_workers(1, args=["--slots", "1"])  # a third worker, so the retry can form a gang again

    psutil.wait_procs(survivors, timeout=LEASE_S + 5)
    stopped_s = time.monotonic() - killed
    assert not [p for p in survivors if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    print(f"the other node's processes were gone {stopped_s:.1f}s after the kill")

    job = wait_terminal(api, job_id, timeout=150)
    nodes = attempts(api, job_id)
    assert job["status"] == "succeeded", (job["error"], [(a["number"], a["node_rank"], a["status"], a["worker"],
                                                           (a["error"] or {}).get("message")) for a in nodes],
                                          [api.get(f"/v1/jobs/{job_id}/logs", params={"node_rank": r}).text[-3000:]
                                           for r in (0, 1)])
    by_attempt = {(a["number"], a["node_rank"]): a for a in nodes}
    assert by_attempt[(current, 1)]["status"] in ("lost", "failed", "stopped")
    assert by_attempt[(current, 0)]["status"] in ("failed", "stopped", "lost")
    last = max(a["number"] for a in nodes)
    assert {by_attempt[(last, r)]["status"] for r in (0, 1)} == {"succeeded"}
    assert not any(a["status"] == "active" for a in nodes)  # never left running half
    assert processes_of(job_id) == []


def test_cancel_stops_every_node(stack, api):
    spec = two_node(name="gang-cancel", train={"max_steps": 100000, "log_every": 100})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] >= 100, 90, what="the gang to train")
    assert len({p.pid for p in processes_of(job_id)}) >= 4  # two torchruns and their ranks
    api.post(f"/v1/jobs/{job_id}/cancel")
    job = wait_terminal(api, job_id, timeout=30)
    assert job["status"] == "cancelled"
    assert sorted((a["node_rank"], a["status"]) for a in attempts(api, job_id)) == [(0, "cancelled"), (1, "cancelled")]
    assert processes_of(job_id) == []  # cancelled only once every process of every node is gone


def test_a_rank_failing_on_one_node_fails_the_gang_as_one_with_that_rank_s_error(stack, api):
    spec = two_node(name="gang-fault", train={"max_steps": 50, "log_every": 5},
                    fault_injection={"raise_at_step": 10, "rank": 1, "message": "boom on rank 1"})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_terminal(api, job_id, timeout=90)
    assert job["status"] == "failed"
    assert job["error"]["type"] == "RuntimeError" and job["error"]["message"] == "boom on rank 1"
    assert job["error"]["node_rank"] in (0, 1)  # c10d decides which node holds global rank 1
    statuses = sorted(a["status"] for a in attempts(api, job_id))
    assert statuses == ["failed", "stopped"]  # one settled the job, the other was stopped with it
    # The failure is the job's at once; the stopped node sees it on its next lease renewal and stops its
    # ranks within the cancel grace (3 s here), so they are gone within seconds, not at once.
    wait_for(lambda: processes_of(job_id) == [], 15, what="the stopped node's processes to go")


def test_two_gangs_submitted_together_on_two_workers_both_run_without_deadlock(stack, api, postgres_url):
    """Each worker may claim node 0 of a different gang at once; the younger gang yields, so neither waits for
    TRAINJOBS_GANG_TIMEOUT_S (were it a deadlock, only the timeout would end it)."""
    live = [w for w in api.get("/v1/workers").json()["items"] if w["state"] != "lost"]
    assert len(live) == 2
    ids = [api.post("/v1/jobs", json=two_node(name=f"pair-{i}")).json()["id"] for i in range(2)]
    for job_id in ids:
        assert wait_terminal(api, job_id, timeout=120)["status"] == "succeeded"
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        released = conn.scalars(select(JobEvent.detail).where(JobEvent.job_id.in_(ids), JobEvent.kind == "queued",
                                                               JobEvent.detail.like("gang not formed%"))).all()
    engine.dispose()
    assert released == []


def test_a_node_whose_ranks_stopped_for_another_node_s_preemption_hands_the_job_back(tmp_path):
    """The preemption all-reduce makes every node's ranks checkpoint and exit 0: that is no success anywhere."""
    spec = JobSpec.model_validate(two_node(train={"max_steps": 200_000}))
    gang = Gang(nnodes=2, node_rank=0, endpoint="127.0.0.1:1", local_addr="127.0.0.1", join_timeout_s=30)
    sup = Supervisor(sessions=None, settings=Settings(data_dir=tmp_path), job_id="j", attempt=1, spec=spec,
                     run_dir=tmp_path, gang=gang)
    sup.metrics.preempted_at_step = 400  # the runtime's `preempted` record, shipped from this node's file
    outcome = sup._outcome(0, None, [])
    assert outcome.status == JobStatus.QUEUED
    assert outcome.detail == "handed back with its gang at step 400: another node's worker is shutting down"
    sup.preempt()  # the node whose worker is shutting down says so
    assert sup._outcome(0, None, []).detail == "preempted by worker shutdown at step 400"


def test_sigterm_to_one_worker_of_a_gang_hands_the_job_back_on_every_node(stack, api, postgres_url):
    spec = two_node(name="gang-preempt", train={"max_steps": 200_000, "log_every": 50})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running"
             and j["progress"]["step"] >= 100, 120, what="the gang to train")
    node_1 = next(a for a in attempts(api, job_id) if a["node_rank"] == 1)
    worker = psutil.Process(int(node_1["worker"].rsplit("-", 1)[1]))
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0
    wait_for(lambda: {a["status"] for a in attempts(api, job_id) if a["number"] == 1} != {"active"}
             and "active" not in {a["status"] for a in attempts(api, job_id) if a["number"] == 1}, 30,
             what="both nodes of attempt 1 to close")
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] in ("queued", "starting") and job["summary"] is None and job["error"] is None
    statuses = {a["node_rank"]: a["status"] for a in attempts(api, job_id) if a["number"] == 1}
    # Whichever node records first hands the job back (preempted) and closes the other (stopped): both orders
    # happen, since every node's ranks checkpoint and exit at the same step.
    assert sorted(statuses.values()) in (["preempted", "preempted"], ["preempted", "stopped"]), statuses
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        kinds = conn.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
    engine.dispose()
    assert "succeeded" not in kinds and "failed" not in kinds
    api.post(f"/v1/jobs/{job_id}/cancel")
    wait_for(lambda: processes_of(job_id) == [], 30, what="every process of the job to go")
