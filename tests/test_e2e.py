"""End to end: real API (uvicorn), real Redis, a real worker process, torchrun with gloo DDP."""

import os
import subprocess
import sys
import time
from datetime import datetime

import psutil
import pytest

from service.artifacts import service as storage
from tests.conftest import mlp_spec
from tests.helpers import module_stack, processes_of, wait_for, wait_terminal

stack = module_stack("e2e")


def test_cli_submit_follow_runs_ddp_job_to_success_with_metrics_and_logs(stack, api, tmp_path):
    spec_file = tmp_path / "job.json"
    spec_file.write_text(__import__("json").dumps(mlp_spec(train={"max_steps": 60, "log_every": 5})))
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token)
    cli = subprocess.run([sys.executable, "-m", "service.cli", "submit", str(spec_file), "--follow"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "succeeded" in cli.stdout and "final_loss" in cli.stdout

    job = api.get("/v1/jobs", params={"limit": 1}).json()["items"][0]
    assert job["status"] == "succeeded" and job["attempt"] == 1 and job["error"] is None
    assert job["progress"]["step"] == 60
    assert job["summary"]["steps"] == 60 and job["summary"]["world_size"] == 2
    assert job["summary"]["samples_per_s"] > 0
    assert job["started_at"] <= job["finished_at"]

    series = {s["name"]: s for s in api.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]}
    assert {"loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "peak_mem_mb"} <= series.keys()
    loss = series["loss"]
    assert loss["steps"] == list(range(5, 61, 5))
    assert loss["values"][-1] < loss["values"][0]
    only_loss = api.get(f"/v1/jobs/{job['id']}/metrics", params={"name": "loss", "after_step": 50}).json()
    assert only_loss["series"] == [{"name": "loss", "steps": [55, 60], "values": loss["values"][-2:]}]

    logs = api.get(f"/v1/jobs/{job['id']}/logs")
    assert "step 60/60" in logs.text and "[trainjobs] done" in logs.text
    tail = api.get(f"/v1/jobs/{job['id']}/logs", params={"offset": int(logs.headers["x-next-offset"]) - 10})
    assert tail.text == logs.text[-10:]
    run_dir = stack.settings.runs_dir / job["id"] / "attempt-1"
    assert (run_dir / "spec.json").exists() and not (run_dir / "tmp").exists()


@pytest.mark.alone  # failed within 10 s of the raise
def test_rank_that_raises_fails_the_job_naming_rank_and_exception(api):
    spec = mlp_spec(fault_injection={"raise_at_step": 3, "rank": 1, "message": "bad batch on purpose"})
    job = api.post("/v1/jobs", json=spec).json()
    job = wait_terminal(api, job["id"])
    assert job["status"] == "failed"
    error = job["error"]
    assert error["rank"] == 1
    assert error["type"] == "RuntimeError"
    assert error["message"] == "bad batch on purpose"
    assert "bad batch on purpose" in error["traceback"]
    # Failed within 10 s of the raise (torchrun's error file stamps it, in whole seconds).
    raised_at = datetime.fromisoformat(error["raised_at"])  # ISO 8601, as every time the API gives
    assert (datetime.fromisoformat(job["finished_at"]) - raised_at).total_seconds() < 10
    assert processes_of(job["id"]) == []


@pytest.mark.alone  # cancelled within the grace + 3 s
def test_cancel_of_running_job_leaves_no_process_alive(api):
    spec = mlp_spec(train={"max_steps": 10_000_000, "log_every": 20})
    job = api.post("/v1/jobs", json=spec).json()
    wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["progress"]["step"] > 0, 120,
             what="training to report steps")
    procs = processes_of(job["id"])
    assert len(procs) >= 3  # torchrun and its two ranks
    started = time.monotonic()
    r = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["cancel_requested_at"] is not None
    done = wait_terminal(api, job["id"], timeout=60)
    assert done["status"] == "cancelled"
    assert time.monotonic() - started < 3 + 2 + 1  # the grace period + 2 s (+ the poll)
    # By the time the API says cancelled, every process of the job is gone.
    alive = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [] and processes_of(job["id"]) == []


def test_cancel_of_finished_job_is_409(api):
    job = api.get("/v1/jobs", params={"status": "succeeded", "limit": 1}).json()["items"]
    if not job:
        pytest.skip("needs the succeeded job of the first test")
    r = api.post(f"/v1/jobs/{job[0]['id']}/cancel")
    assert r.status_code == 409 and "already succeeded" in r.json()["detail"]


def test_job_past_its_timeout_is_killed_and_failed(api):
    spec = mlp_spec(train={"max_steps": 10_000_000, "log_every": 50}, timeout_s=4)
    job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"], timeout=90)
    assert job["status"] == "failed"
    assert job["error"]["type"] == "timeout" and "timeout_s=4" in job["error"]["message"]
    assert processes_of(job["id"]) == []


def test_cli_reports_a_bad_spec_naming_the_field(stack, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {type: mlp}\ndata: {type: synthetic_regression, batch_size: 0}\n")
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token)
    cli = subprocess.run([sys.executable, "-m", "service.cli", "submit", str(bad)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2
    # One sentence about the field, not one per branch of its union (int >= 1 or "auto") under the data's tag.
    assert "body.data.batch_size: Input should be greater than or equal to 1, or 'auto'" in cli.stdout, cli.stdout


def test_fsdp_gpt_job_checkpoints_evaluates_and_leaves_its_model_as_an_artifact(stack, api):
    spec = mlp_spec(strategy="fsdp", model={"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
                    data={"type": "synthetic_lm", "num_samples": 256, "batch_size": 8},
                    train={"max_steps": 30, "log_every": 5, "checkpoint_every": 10, "eval_every": 15})
    job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["tokens_per_s"] > 0 and job["summary"]["eval_loss"] > 0
    series = {s["name"]: s for s in api.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]}
    assert series["loss"]["values"][-1] < series["loss"]["values"][0]
    assert series["eval_loss"]["steps"] == [15, 30]
    assert "fsdp on 2 x cpu" in api.get(f"/v1/jobs/{job['id']}/logs").text

    checkpoints = storage.checkpoint_dir(stack.settings, job["id"])
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000020", "step_00000030"]
    listed = api.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]
    assert [f["name"] for f in listed] == ["model.pt"]
    weights = api.get(f"/v1/jobs/{job['id']}/artifacts/model.pt")
    assert weights.status_code == 200 and len(weights.content) == listed[0]["size"]


def test_the_sdk_submits_waits_and_reads_logs_metrics_and_artifacts(stack, tmp_path, monkeypatch):
    """trainjobs.Client from a user's Python: configured by the environment, like the CLI."""
    from trainjobs import APIError, Client

    monkeypatch.setenv("TRAINJOBS_API_URL", stack.api_url)
    monkeypatch.setenv("TRAINJOBS_TOKEN", stack.token)
    with Client() as c:
        job = c.submit(mlp_spec(name="sdk", train={"max_steps": 20, "log_every": 5}))
        with pytest.raises(TimeoutError, match=job["id"]):
            c.wait(job["id"], timeout=0.1)  # not yet: it has to start torch
        job = c.wait(job["id"], timeout=180)
        assert job["status"] == "succeeded" and job["summary"]["steps"] == 20
        assert c.get(job["id"])["id"] == job["id"] and job["id"] in [j["id"] for j in c.list()["items"]]

        assert "final loss" in c.logs(job["id"])
        assert "final loss" in "".join(c.logs(job["id"], follow=True))  # an ended job: its whole log, then stop
        [loss] = c.metrics(job["id"], name="loss")["series"]
        assert loss["steps"] == [5, 10, 15, 20]

        [model] = c.artifacts(job["id"])
        saved = c.download(job["id"], "model.pt", tmp_path)
        assert saved == tmp_path / "model.pt" and saved.stat().st_size == model["size"]
        assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no partial file left beside it

        with pytest.raises(APIError) as missing:
            c.get("0" * 20)
        assert missing.value.status == 404 and "not found" in str(missing.value.detail)
        with pytest.raises(APIError) as refused:
            c.submit(mlp_spec(env={"LD_PRELOAD": "x"}))
        assert refused.value.status == 422 and "LD_PRELOAD" in str(refused.value)
        with pytest.raises(APIError) as done:
            c.cancel(job["id"])
        assert done.value.status == 409
