"""Idle devices (issue 18): the supervisor samples its job's GPUs (NVML, else nvidia-smi) or, on CPU, each
rank's CPU use, into the job's metrics; a job below idle.min_util for idle.window_s gets a warning once per
attempt, or with idle.action fail fails with `idle`. CPU here; the GPU readers on a fake nvidia-smi."""

import os
import subprocess
import sys
import time

from sqlalchemy import create_engine, select

from service.jobs.models import JobEvent
from service.settings import Settings
from tests.conftest import mlp_spec
from tests.helpers import module_stack, wait_terminal
from trainjobs.spec import JobSpec
from worker import usage, watch
from worker.shipping import MetricTail

stack = module_stack("idle", workers=2, usage_sample_s=0.5)  # two: a sleeping job beside a busy one
IDLE = {"window_s": 3}
# Rank 1 sleeps every step and rank 0 waits for it in the gradient's all_reduce: neither uses its CPU.
SLEEPS = {"sleep_per_step_s": 0.5, "rank": 1}


def idle_events(url: str, job_id: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            return list(db.execute(select(JobEvent.detail).where(JobEvent.job_id == job_id,
                                                                  JobEvent.kind == "idle")).scalars())
    finally:
        engine.dispose()


def test_sleeping_ranks_are_named_idle_once_a_busy_job_is_not_and_each_ranks_cpu_is_a_series(api, stack,
                                                                                              postgres_url):
    sleeping = api.post("/v1/jobs", json=mlp_spec(name="sleeps", idle=IDLE, fault_injection=SLEEPS, train={
        "max_steps": 16, "log_every": 2, "seed": 0})).json()["id"]
    busy = api.post("/v1/jobs", json=mlp_spec(name="busy", idle=IDLE, train={
        "max_steps": 3000, "log_every": 500, "seed": 0})).json()["id"]
    sleeping, busy = wait_terminal(api, sleeping), wait_terminal(api, busy)
    assert sleeping["status"] == busy["status"] == "succeeded", (sleeping["error"], busy["error"])

    [warning] = [w for w in sleeping["warnings"] if w["kind"] != "straggler"]  # once, though idle for longer
    assert warning["kind"] == "idle" and warning["attempt"] == 1, warning
    assert "every rank's CPU use (rank 0: " in warning["message"] and "below idle.min_util=5%" in warning["message"]
    assert idle_events(postgres_url, sleeping["id"]) == [warning["message"]]
    status = subprocess.run([sys.executable, "-m", "service.cli", "status", sleeping["id"]], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "TRAINJOBS_API_URL": stack.api_url,
                                                        "TRAINJOBS_TOKEN": stack.token or "", "COLUMNS": "400"})
    assert f"warning (idle): {warning['message']}" in status.stdout, status.stdout + status.stderr
    series = {s["name"]: s for s in api.get(f"/v1/jobs/{sleeping['id']}/metrics").json()["series"]}
    assert {"cpu_util/rank0", "cpu_util/rank1"} <= set(series), list(series)
    # Most samples show the sleeping rank idle; its start and its end (the final checkpoint) may not be.
    rank1 = sorted(series["cpu_util/rank1"]["values"])
    assert rank1[len(rank1) // 2] < 5, series["cpu_util/rank1"]

    assert busy["warnings"] == [], busy["warnings"]  # nor a straggler: its ranks are even
    busy_series = {s["name"]: s for s in api.get(f"/v1/jobs/{busy['id']}/metrics").json()["series"]}
    assert max(busy_series["cpu_util/rank0"]["values"]) >= 5, busy_series["cpu_util/rank0"]


def test_idle_action_fail_fails_the_job_with_idle_and_does_not_retry(api, stack):
    spec = mlp_spec(name="idle-fails", max_retries=1, idle={**IDLE, "action": "fail"}, fault_injection=SLEEPS,
                    train={"max_steps": 200, "log_every": 2, "seed": 0})
    started = time.monotonic()
    job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"], timeout=90)
    assert job["status"] == "failed" and job["error"]["type"] == "idle", job["error"]
    assert job["error"]["message"].startswith("every rank's CPU use (rank 0: "), job["error"]["message"]
    assert [w["kind"] for w in job["warnings"] if w["kind"] != "straggler"] == ["idle"]
    assert len(api.get(f"/v1/jobs/{job['id']}/attempts").json()["data"]) == 1
    assert time.monotonic() - started < 60  # 200 steps of 0.5 s would take 100 s


def fake_nvidia_smi(folder, lines: list[str]) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text("#!/bin/sh\nprintf '" + "\\n".join(lines) + "\\n'\n")
    exe.chmod(0o755)


def test_the_gpus_are_read_from_nvidia_smi_by_index_or_uuid_and_an_idle_one_is_named(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, ["0, GPU-aaa, 0, 1024", "1, GPU-bbb, 3, 2048", "2, GPU-ccc, 97, 4096"])
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # NVML unavailable: nvidia-smi then
    assert usage.job_gpus(2, visible="") == ["0", "1"]
    assert usage.job_gpus(2, visible="GPU-bbb,GPU-ccc,GPU-aaa") == ["GPU-bbb", "GPU-ccc"]
    reader = usage.GpuReader(["GPU-ccc", "0"])
    assert reader.source == "nvidia-smi"
    assert reader.read() == [usage.Gpu(97.0, 4096 * 2**20), usage.Gpu(0.0, 1024 * 2**20)]
    assert usage.GpuReader(["7"]).read() is None  # a device nvidia-smi does not list: no reading, no verdict

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    spec = JobSpec.model_validate(mlp_spec(resources={"nproc_per_node": 2, "device": "cuda"},
                                           idle={"window_s": 0.2, "action": "fail"}))
    seen = watch.Watch(spec=spec, settings=Settings(usage_sample_s=0.01), job_id="j", attempt=1,
                       metrics=MetricTail(tmp_path / "none.jsonl"))
    verdicts = []
    deadline = time.monotonic() + 5
    while not verdicts and time.monotonic() < deadline:
        time.sleep(0.02)
        verdicts = [v for v in [seen.poll(torchrun_pid=1)] if v]
    assert verdicts == ["idle"]
    assert seen.idle_message.startswith("the job's GPUs (0%, 3% at the last sample) stayed below")
    names = {name: value for _, name, value, _ in seen.samples_pending}
    assert names == {"gpu_util": 1.5, "gpu_mem": 3072.0}
    assert [w["kind"] for w in seen.warnings_pending] == ["idle"]
