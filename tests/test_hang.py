"""Jobs that watch themselves (issue 18): a job that stops making progress is caught with every rank's stack
(py-spy), stored on the attempt, and then retried, failed or only reported (spec.hang); the stacks of a healthy
running job on demand (POST /v1/jobs/{id}/stacks) without disturbing it."""

import time

import psutil
from sqlalchemy import create_engine, select

from service.jobs import retries
from service.jobs.models import JobEvent
from tests.conftest import mlp_spec
from tests.helpers import module_stack, processes_of, wait_for, wait_terminal
from worker import stacks

stack = module_stack("hang", allow_entrypoints=True)

SILENT = '''\
import os, time
print("rank", os.environ["RANK"], "starting", flush=True)
time.sleep(float(os.environ.get("SLEEP_S", "3600")))
print("rank", os.environ["RANK"], "woke up", flush=True)
'''


def events(url: str, job_id: str, kind: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            return [e.detail for e in db.execute(select(JobEvent).where(JobEvent.job_id == job_id,
                                                                          JobEvent.kind == kind))]
    finally:
        engine.dispose()


def test_a_rank_that_blocks_is_caught_with_every_ranks_stack_retried_from_its_checkpoint_then_failed(api, stack):
    spec = mlp_spec(name="hangs", max_retries=2, hang={"min_s": 4},
                    train={"max_steps": 40, "log_every": 5, "seed": 0, "checkpoint_every": 10},
                    fault_injection={"hang_at_step": 20, "rank": 1, "attempt": None})
    started = time.monotonic()
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_terminal(api, job_id, timeout=120)
    took = time.monotonic() - started
    attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    assert job["status"] == "failed" and job["error"]["type"] == "hang", job["error"]
    assert len(attempts) == 2, attempts  # retried once; the second hang is final, with a retry left unspent
    assert attempts[1]["resumed_from_step"] == 20
    assert took < 60
    for attempt in attempts:
        dump = attempt["stacks"]
        assert dump["reason"] == "hang" and [r["rank"] for r in dump["ranks"]] == [0, 1]
        rank0, rank1 = dump["ranks"]
        assert "hang_forever" in rank1["text"], rank1["text"]
        assert "train_step" in rank0["text"] or "mean_across_ranks" in rank0["text"], rank0["text"]
        assert "MainThread" in rank0["text"]
    assert "rank 1: in hang_forever" in job["error"]["message"], job["error"]["message"]
    assert "rank 0: in " in job["error"]["message"] and "bound 4s" in job["error"]["message"]
    assert not processes_of(job_id)


def test_a_script_silent_past_the_bound_is_hung_by_its_output_and_fail_does_not_retry(api, stack):
    (stack.settings.data_dir / "scripts").mkdir(exist_ok=True)
    (stack.settings.data_dir / "scripts" / "silent.py").write_text(SILENT)
    spec = {"name": "silent", "max_retries": 2, "resources": {"nproc_per_node": 2},
            "hang": {"min_s": 3, "action": "fail"}, "entrypoint": {"script": "silent.py"}}
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_terminal(api, job_id, timeout=60)
    [attempt] = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    assert job["status"] == "failed" and job["error"]["type"] == "hang"
    assert "no step reported and no output for" in job["error"]["message"]
    assert "rank 0: in <module> (silent.py:3)" in job["error"]["message"], job["error"]["message"]
    assert [r["rank"] for r in attempt["stacks"]["ranks"]] == [0, 1]
    assert not processes_of(job_id)


def test_report_keeps_the_job_running_and_records_the_hang(api, stack, postgres_url):
    (stack.settings.data_dir / "scripts").mkdir(exist_ok=True)
    (stack.settings.data_dir / "scripts" / "silent.py").write_text(SILENT)
    spec = {"name": "slow-start", "env": {"SLEEP_S": "6"}, "hang": {"min_s": 2, "action": "report"},
            "entrypoint": {"script": "silent.py"}}
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    job = wait_terminal(api, job_id, timeout=60)
    [attempt] = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
    assert job["status"] == "succeeded", job["error"]
    assert "woke up" in api.get(f"/v1/jobs/{job_id}/logs").text
    assert attempt["stacks"]["reason"] == "hang" and "silent.py:3" in attempt["stacks"]["ranks"][0]["where"]
    [hung] = events(postgres_url, job_id, "hung")  # once, though it stayed silent for twice the bound
    assert "no step reported and no output" in hung


def test_stacks_of_a_healthy_job_on_demand_leave_it_as_an_undisturbed_run(api, stack):
    # 5 ms a step, so the job still runs when its stacks are taken (it ended first once, in CI: no ranks to dump).
    spec = mlp_spec(name="asked", train={"max_steps": 1000, "log_every": 50, "seed": 0},
                    fault_injection={"sleep_per_step_s": 0.005, "rank": 0})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] >= 50, 60, what="training")
    answer = api.post(f"/v1/jobs/{job_id}/stacks")
    assert answer.status_code == 200, answer.text
    [node] = answer.json()["data"]
    assert node["stacks"]["reason"] == "requested" and [r["rank"] for r in node["stacks"]["ranks"]] == [0, 1]
    assert all("MainThread" in r["text"] for r in node["stacks"]["ranks"])
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    again = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"], timeout=120)
    losses = [api.get(f"/v1/jobs/{j['id']}/metrics", params={"name": "loss"}).json()["series"][0]["values"]
              for j in (job, again)]
    assert losses[0] == losses[1]  # the dump read the ranks' memory; it changed nothing
    finished = api.post(f"/v1/jobs/{job_id}/stacks")
    assert finished.status_code == 409 and finished.json()["field"] == "status"


def test_where_names_the_innermost_frame_and_the_users_line_under_it():
    lib = f"{psutil.__file__.rsplit('/psutil/', 1)[0]}"  # a site-packages folder
    text = (f'Process 1: python train.py\nPython v3.11.7\n\nThread 1 (idle): "MainThread"\n'
            f"    all_reduce ({lib}/torch/distributed/distributed_c10d.py:3252)\n"
            f"    wrapper ({lib}/torch/distributed/c10d_logger.py:83)\n"
            "    step (/home/me/project/train.py:88)\n    <module> (/home/me/project/train.py:120)\n"
            'Thread 2 (idle): "pin_memory"\n    run (/usr/lib/python3.11/threading.py:975)\n')
    assert stacks.where(text) == ("in all_reduce (torch/distributed/distributed_c10d.py:3252), "
                                  "called from train.py:88")
    assert stacks.where("Process 1\nThread 1 (idle): \"MainThread\"\n    <module> (/x/silent.py:3)\n") == \
        "in <module> (silent.py:3)"
    assert stacks.where("py-spy failed: permission denied") == "unknown (no Python stack)"
    # A script that never imported threading: py-spy names no thread; the first is the main one.
    assert stacks.where("Thread 20442 (idle)\n    <module> (/tmp/x/silent.py:3)\n") == "in <module> (silent.py:3)"


def test_a_hang_is_retried_once_and_never_when_its_action_is_fail():
    hang = {"type": "hang", "message": "hung: ..."}
    assert retries.is_retryable(hang, [])
    assert not retries.is_retryable(hang, [{"type": "hang", "message": "hung: elsewhere"}])
    assert not retries.is_retryable({**hang, "final": True}, [])
