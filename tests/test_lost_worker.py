"""Lost and paused workers, end to end: real API, two real workers, real torchrun, PostgreSQL, Redis.

A worker killed with kill -9 (with its work-horse: the whole machine gone) loses its lease; the sweeper
gives the job to the other worker, which resumes it from the newest checkpoint. A worker paused past its
lease (SIGSTOP) finds on waking that its job is gone, and writes nothing more.
"""

import os
import signal

import psutil
import pytest
from sqlalchemy import create_engine, func, select, text

from service.cli.stack import Stack
from service.jobs.models import Attempt
from service.logs.models import LogChunk
from service.metrics.models import Metric
from tests.conftest import mlp_spec
from tests.helpers import module_stack, processes_of, wait_for, wait_terminal

LEASE_S = 4.0


stack = module_stack("lost", workers=2, lease_s=LEASE_S, heartbeat_s=0.5, sweep_s=0.5)


def long_job(**overrides) -> dict:
    # ~1 ms steps: long enough to kill mid-run, short enough to finish soon after.
    return mlp_spec(max_retries=1, data={"type": "synthetic_regression", "num_samples": 4096, "batch_size": 16},
                    train={"max_steps": 6000, "log_every": 100, "checkpoint_every": 500}, **overrides)


def running_past(api, job_id: str, step: int) -> dict:
    def past():
        job = api.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] == "running" and job["progress"]["step"] >= step else None
    return wait_for(past, 90, what=f"job {job_id} past step {step}")


def worker_tree(stack: Stack, attempt: dict) -> list[psutil.Process]:
    """The worker process that holds the attempt, its work-horse, torchrun and the ranks."""
    pid = int(attempt["worker"].rsplit("-", 1)[1])
    assert any(p.pid == pid for _, p in stack.procs), attempt["worker"]
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def attempts(api, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]


@pytest.mark.parametrize("trial", [1, 2, 3])
def test_a_job_whose_worker_is_killed_finishes_on_another_resumed_from_a_checkpoint(stack, api, trial):
    job_id = api.post("/v1/jobs", json=long_job(name=f"kill-{trial}")).json()["id"]
    running_past(api, job_id, 1200)  # a checkpoint at 1000 at least
    (first,) = attempts(api, job_id)
    for proc in worker_tree(stack, first)[:2]:  # the worker and its work-horse, as if the machine died
        proc.kill()
    stack.add_workers(1)  # keep two workers for the next trial

    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    assert job["attempt"] == 2 and job["summary"]["steps"] == 6000
    lost, second = attempts(api, job_id)
    assert lost["status"] == "lost" and second["status"] == "succeeded"
    assert second["worker"] != lost["worker"]
    assert second["resumed_from_step"] >= 1000  # not from step 0
    assert lost["finished_at"] <= second["started_at"]  # never two attempts at once
    assert job["error"]["attempts"][0]["type"] == "worker_lost"
    steps = api.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"][0]["steps"]
    # One value per step: the resumed attempt's after its checkpoint (the lost one's past it are replaced), the
    # lost attempt's before. Points it had not shipped when its machine died went with it, and its last checkpoint
    # may be newer than them (~1 ms steps, a ship every 0.5 s): up to the resume the series is every step up to
    # the last one shipped (1200 at least: the test saw it), no hole, no repeat.
    resumed = second["resumed_from_step"]
    before = [s for s in steps if s <= resumed]
    assert before == list(range(100, 100 * len(before) + 1, 100)) and len(before) >= min(resumed, 1200) // 100
    assert [s for s in steps if s > resumed] == list(range(resumed + 100, 6001, 100))
    assert processes_of(job_id) == []


def sessions_of(url: str) -> str:
    """What the database's sessions were doing (and who blocked whom), for a failure's message."""
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT pid, application_name, state, wait_event_type, wait_event, pg_blocking_pids(pid), "
            "now() - xact_start, left(query, 120) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()")).all()
    engine.dispose()
    return "\n".join(" | ".join(str(v) for v in row) for row in rows)


# NOTE: the worker freezes wherever it happens to be, often inside its shipping transaction, holding the job's row
# in a state PostgreSQL's idle timeout may not end (service/db.py): the sweeper ends that worker's sessions
# (tests/test_frozen_worker.py pins it). Should the settle ever be late again, the sessions are printed.
# alone: it times a lease running out around a stopped process (a wall-clock bound). The SIGABRT of
# test_entrypoint's DDP script once blamed on it was torch's gloo abort at exit (worker/user_main.py).
@pytest.mark.alone
def test_a_paused_worker_finds_its_job_given_away_and_writes_nothing_after_it_wakes(stack, api, postgres_url):
    job_id = api.post("/v1/jobs", json=long_job(name="paused")).json()["id"]
    running_past(api, job_id, 600)
    (first,) = attempts(api, job_id)
    tree = worker_tree(stack, first)
    for proc in tree:  # the whole worker stops, training included, like a frozen VM
        proc.send_signal(signal.SIGSTOP)
    try:
        try:
            wait_for(lambda: len(attempts(api, job_id)) == 2 and attempts(api, job_id)[1]["status"] == "active",
                     60, what="the job to move to the other worker")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the database's sessions:\n{sessions_of(postgres_url)}") from None
        engine = create_engine(postgres_url)
        with engine.connect() as conn:
            def written():
                return [conn.scalar(select(func.count()).select_from(t).where(t.job_id == job_id, t.attempt == 1))
                        for t in (Metric, LogChunk)]
            before = written()
    finally:
        for proc in tree:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass

    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded" and job["attempt"] == 2
    assert [a["status"] for a in attempts(api, job_id)] == ["lost", "succeeded"]
    with engine.connect() as conn:
        assert written() == before  # the woken worker wrote no metric and no log line for attempt 1
        events = conn.execute(select(Attempt.number, Attempt.status).where(Attempt.job_id == job_id)).all()
    engine.dispose()
    assert sorted(events) == [(1, "lost"), (2, "succeeded")]
    wait_for(lambda: processes_of(job_id) == [], 15, what="the stale attempt's processes to go")
    assert all(p.is_running() for p in tree[:1])  # the woken worker itself goes on serving
    assert os.path.exists(stack.settings.data_dir)


def test_a_rank_killed_by_a_signal_is_retried_and_resumes(stack, api):
    job_id = api.post("/v1/jobs", json=long_job(name="rank-kill")).json()["id"]
    running_past(api, job_id, 1200)
    (first,) = attempts(api, job_id)
    torchrun = next(p for p in worker_tree(stack, first) if "torch.distributed.run" in " ".join(p.cmdline()))
    torchrun.children()[-1].kill()  # one rank, SIGKILL: no Python exception, no error file

    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    failed, second = attempts(api, job_id)
    assert failed["status"] == "failed" and second["status"] == "succeeded"
    assert second["resumed_from_step"] >= 1000
    assert job["error"]["attempts"][0]["attempt"] == 1  # the cause of the retry is kept
