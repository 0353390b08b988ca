"""Graceful preemption: a worker's SIGTERM checkpoints the job, hands it back to the queue, and another resumes it."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from redis import Redis
from redis.client import PubSub
from rq import Worker
from rq.serializers import JSONSerializer
from sqlalchemy import create_engine, select

from service.artifacts import service as storage
from service.cli.stack import Stack
from service.jobs.models import JobEvent
from tests.conftest import REDIS_URL, mlp_spec
from tests.helpers import module_stack, processes_of, run_torchrun, wait_for, wait_terminal
from trainjobs import runenv
from trainjobs.runenv import parse_record
from trainjobs.spec import JobSpec
from worker import launch, processes
from worker import main as worker_main
from worker.main import PreemptingWorker
from worker.train.checkpoint import complete_checkpoints


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["metrics"]["loss"] for r in records if r["type"] == "metrics"}


def read_records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_torchrun(spec: dict, run_dir, *, job_dir) -> subprocess.Popen:
    """The runtime under torchrun as the supervisor starts it (PREEMPT_SIGNAL ignored until a rank handles it)."""
    job_spec = JobSpec.model_validate(spec)
    (run_dir / "tmp").mkdir(parents=True)
    (run_dir / runenv.SPEC_FILE).write_text(job_spec.model_dump_json())
    plan = launch.render(job_spec, job_id="bare", attempt=1, run_dir=run_dir, python=sys.executable, data_dir=run_dir,
                         job_dir=job_dir, shutdown_grace_s=5, base_env=launch.default_env(), cpu_count=2)
    return subprocess.Popen(plan.argv, env=plan.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=processes.prepare_torchrun)


def test_preempted_ranks_checkpoint_at_one_step_and_the_next_attempt_resumes_onto_the_same_losses(tmp_path):
    train = {"max_steps": 1500, "log_every": 1, "seed": 3}  # no checkpoint_every: only the preemption's one
    spec = mlp_spec(train=train)
    whole = losses(run_torchrun(spec, tmp_path / "whole"))

    job_dir = tmp_path / "job"
    proc = start_torchrun(spec, tmp_path / "attempt-1", job_dir=job_dir)
    try:
        wait_for(lambda: len(read_records(tmp_path / "attempt-1")) >= 20, 120, interval=0.05, what="training")
        assert processes.signal_ranks(proc.pid, runenv.PREEMPT_SIGNAL) == 2
        processes.signal_ranks(proc.pid, runenv.PREEMPT_SIGNAL)  # a repeat changes nothing
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    first = read_records(tmp_path / "attempt-1")
    preempted = [r for r in first if r["type"] == "preempted"]
    assert len(preempted) == 1 and not any(r["type"] == "summary" for r in first)
    step = preempted[0]["step"]
    assert 20 <= step < 1500 and max(losses(first)) == step
    assert f"[trainjobs] preempted at step {step}: checkpoint saved" in output
    assert [p.name for p in complete_checkpoints(job_dir / "checkpoints")] == [f"step_{step:08d}"]
    assert [losses(first)[s] for s in losses(first)] == pytest.approx([whole[s] for s in losses(first)], abs=1e-6)

    second = run_torchrun(spec, tmp_path / "attempt-2", attempt=2, job_dir=job_dir)
    assert next(r["summary"] for r in second if r["type"] == "summary")["resumed_from_step"] == step
    resumed = losses(second)
    assert sorted(resumed) == list(range(step + 1, 1501))
    assert [resumed[s] for s in resumed] == pytest.approx([whole[s] for s in resumed], abs=1e-5, rel=0)


def test_the_preempted_record_is_shipped_not_skipped():
    assert parse_record(b'{"type": "preempted", "time": 1.0, "step": 41}') == {"type": "preempted", "time": 1.0,
                                                                              "step": 41}
    assert parse_record(b'{"type": "preempted", "time": 1.0, "step": -1}') is None


def test_a_worker_leaves_its_pubsub_channel_at_once_even_when_its_listener_reads_the_reply_first(monkeypatch):
    # RQ's order (unsubscribe, then stop) let a listener that read the reply first wait 60 s for a subscription:
    # on a busy machine a worker took a minute to exit after a warm shutdown. The main thread is slowed here on
    # purpose between the two, as a busy machine slows it.
    conn = Redis.from_url(REDIS_URL)
    rq_worker = PreemptingWorker([], connection=conn, serializer=JSONSerializer, name=f"unsub-{time.time_ns()}")
    rq_worker.subscribe()
    thread = rq_worker.pubsub_thread
    wait_for(lambda: rq_worker.pubsub.subscribed, 10, interval=0.01, what="the subscription")
    sent = PubSub.unsubscribe

    def unsubscribe_then_stall(pubsub, *args):
        result = sent(pubsub, *args)
        time.sleep(0.5)  # the listener reads the reply meanwhile
        return result

    monkeypatch.setattr(PubSub, "unsubscribe", unsubscribe_then_stall)
    started = time.monotonic()
    rq_worker.unsubscribe()
    assert time.monotonic() - started < 3
    assert not thread.is_alive() and rq_worker.pubsub.connection is None
    conn.close()


def test_a_sigterm_while_a_worker_starts_ends_it_cleanly_without_registering_it_in_redis():
    # The database registers a worker before RQ's loop installs its handlers: a SIGTERM in between killed it
    # (status -15, its row left to expire as lost; CI saw it). Now it is remembered, and RQ's start stops at once.
    conn = Redis.from_url(REDIS_URL)
    name = f"early-{time.time_ns()}"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker_main.catch_stop_early()
        os.kill(os.getpid(), signal.SIGTERM)  # this process survives it: the worker's start has begun
        started = time.monotonic()
        worker_main.serve(lambda: PreemptingWorker([], connection=conn, serializer=JSONSerializer, name=name),
                          burst=False)  # returns: a stop, not a loop waiting for jobs
        assert time.monotonic() - started < 5
        assert name not in {w.name for w in Worker.all(connection=conn)}
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        conn.close()


stack = module_stack("pre", reconcile_s=1, sweep_s=0.5)


def live_worker(stack: Stack) -> subprocess.Popen:
    """The stack's one running worker, started if the previous test stopped it."""
    alive = [p for name, p in stack.procs if name.startswith("worker") and p.poll() is None]
    if not alive:
        stack.add_workers(1)
        alive = [stack.procs[-1][1]]
    assert len(alive) == 1
    return alive[0]


def events(url: str, job_id: str) -> list[tuple[str, str | None]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(select(JobEvent.kind, JobEvent.detail).where(JobEvent.job_id == job_id)
                            .order_by(JobEvent.id)).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def test_sigterm_to_a_worker_hands_its_job_back_and_a_new_worker_resumes_it(stack, api, postgres_url):
    worker = live_worker(stack)
    spec = mlp_spec(train={"max_steps": 3000, "log_every": 50, "checkpoint_every": 100_000})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: (api.get(f"/v1/jobs/{job_id}").json()["progress"] or {}).get("step", 0) >= 100, 120,
             interval=0.1, what="training to pass step 100")
    procs = processes_of(job_id)
    assert len(procs) >= 3  # torchrun and its two ranks
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0  # a warm shutdown: the job was handed back, then the worker left

    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["error"] is None and job["attempt"] == 1
    assert [a["status"] for a in api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]] == ["preempted"]
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert processes_of(job_id) == []
    logs = api.get(f"/v1/jobs/{job_id}/logs").text
    step = int(logs.split("[trainjobs] preempted at step ")[1].split(":")[0])
    assert 100 <= step < 3000 and f"preempted at step {step}: checkpoint saved" in logs
    assert ("queued", f"preempted by worker shutdown at step {step}") in events(postgres_url, job_id)
    checkpoints = storage.checkpoint_dir(stack.settings, job_id)
    assert [p.name for p in complete_checkpoints(checkpoints)] == [f"step_{step:08d}"]

    live_worker(stack)
    job = wait_terminal(api, job_id, timeout=180)
    assert job["status"] == "succeeded" and job["attempt"] == 2, job["error"]
    assert job["summary"]["resumed_from_step"] == step and job["summary"]["steps"] == 3000
    attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    assert [(a["status"], a["resumed_from_step"]) for a in attempts] == [("preempted", None), ("succeeded", step)]
    loss = next(s for s in api.get(f"/v1/jobs/{job_id}/metrics").json()["series"] if s["name"] == "loss")
    assert loss["steps"] == list(range(50, 3001, 50))


def test_a_second_sigterm_stops_the_ranks_at_once_and_still_hands_the_job_back(stack, api, postgres_url):
    worker = live_worker(stack)
    job_id = api.post("/v1/jobs", json=mlp_spec(train={"max_steps": 10_000_000, "grad_accum_steps": 64})).json()["id"]
    # Right after the ranks start: still importing torch, they cannot checkpoint yet (and must not die of it).
    wait_for(lambda: len(processes_of(job_id)) >= 3, 60, interval=0.02, what="the ranks to start")
    worker.send_signal(signal.SIGTERM)
    # RQ takes a second signal within 1 s of the first for an echo of it. NOTE: importing torch, joining the
    # group and two (slow) steps take the ranks longer than this, so the hard stop is what ends them.
    time.sleep(1.1)
    assert len(processes_of(job_id)) >= 3  # the supervisor's SIGUSR1 reached them a second ago: ignored
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["error"] is None
    assert [a["status"] for a in api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]] == ["preempted"]
    assert ("queued", "preempted by worker shutdown; it resumes from its last checkpoint") in events(postgres_url,
                                                                                                     job_id)
    assert processes_of(job_id) == []
    api.post(f"/v1/jobs/{job_id}/cancel")  # not for the next test's worker


def test_a_third_sigterm_kills_the_work_horse_and_no_process_of_the_job_survives(stack, api):
    worker = live_worker(stack)
    job_id = api.post("/v1/jobs", json=mlp_spec(train={"max_steps": 10_000_000})).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 60, interval=0.05, what="launch")
    wait_for(lambda: len(processes_of(job_id)) >= 3, 30, interval=0.05, what="the ranks")
    worker.send_signal(signal.SIGTERM)
    time.sleep(1.2)
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # two signals before Python's handler runs are one
    worker.send_signal(signal.SIGTERM)  # RQ's cold shutdown: SIGKILL to the work-horse, whatever it was doing
    worker.wait(timeout=30)
    wait_for(lambda: processes_of(job_id) == [], 30, what="every process of the job to end")
    api.post(f"/v1/jobs/{job_id}/cancel")
