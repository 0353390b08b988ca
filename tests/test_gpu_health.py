"""A GPU that turns unhealthy under a running job (issue 30), on CPU: the worker's nvidia-smi is a fake whose answer
the test edits. The worker's heartbeat marks the GPU `unhealthy` in /v1/workers, placement leaves it out, and the
attempt on it is stopped and retried on a healthy GPU, with an error that names the device."""

import os
import time
from pathlib import Path

import pytest

from tests.helpers import live_stack, wait_for, wait_terminal
from worker import devices

GPUS = {0: "GPU-aaaa-0000", 1: "GPU-bbbb-1111"}
BUS = {0: "00000000:07:00.0", 1: "00000000:0F:00.0"}
TOPO = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\t0-1\tN/A\nGPU1\tNV4\t X \t0-1\tN/A\n"


def fake_nvidia_smi(folder: Path) -> Path:
    """nvidia-smi answering from files: query.txt (the GPUs' rows, what a test edits), topo.txt."""
    (folder / "topo.txt").write_text(TOPO)
    write_query(folder, lost=None)
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncase \"$1\" in\n  topo) cat {folder}/topo.txt ;;\n"
                   f"  --query-gpu=memory.total) echo 81559; echo 81559 ;;\n  *) cat {folder}/query.txt ;;\nesac\n")
    exe.chmod(0o755)
    return folder


def write_query(folder: Path, *, lost: int | None) -> None:
    """The GPUs' rows; GPU `lost` fallen off the bus (nvidia-smi then prints an error line in its place)."""
    rows = [f"{i}, {uuid}, 81559, {BUS[i]}" if i != lost else
            f"Unable to determine the device handle for GPU{BUS[i]}: GPU is lost.  Reboot the system to recover"
            for i, uuid in GPUS.items()]
    tmp = folder / "query.tmp"
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(folder / "query.txt")


def test_health_reads_a_gpu_fallen_off_the_bus_and_one_whose_row_answers_an_error(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert devices.gpu_health(list(GPUS.values())) == {GPUS[0]: None, GPUS[1]: None}
    write_query(tmp_path, lost=1)
    health = devices.gpu_health(list(GPUS.values()))
    assert health[GPUS[0]] is None and "no longer lists it" in health[GPUS[1]] and "GPU is lost" in health[GPUS[1]]
    (tmp_path / "query.txt").write_text(f"0, {GPUS[0]}, [Unknown Error], {BUS[0]}\n1, {GPUS[1]}, 81559, {BUS[1]}\n")
    assert devices.gpu_health([GPUS[0]]) == {GPUS[0]: "nvidia-smi reports '[Unknown Error]'"}
    watch = devices.HealthWatch([(0, GPUS[0])], every_s=0)
    assert watch.poll() == f"GPU 0 ({GPUS[0]}) turned unhealthy: nvidia-smi reports '[Unknown Error]'"


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-health")
    fake = fake_nvidia_smi(root)
    with live_stack(postgres_url, root / "data", name="gpuhealth", workers=0, allow_entrypoints=True,
                    scripts_dir=Path(__file__).with_name("gpu_health"), heartbeat_s=0.5, worker_max_jobs=2,
                    cancel_grace_s=2) as s:
        s.add_workers(1, args=["--device", "cuda", "--slots", "2"], env={"PATH": f"{fake}:{os.environ['PATH']}"})
        s.fake = fake
        yield s


def test_a_gpu_lost_under_a_job_is_taken_out_of_placement_and_its_job_retried_on_a_healthy_one(stack):
    spec = {"name": "on-a-gpu", "resources": {"nproc_per_node": 1, "device": "cuda"}, "max_retries": 2,
            "entrypoint": {"script": "sleepy.py"}, "timeout_s": 300}
    with stack.client(timeout=10) as api:
        wait_for(lambda: api.get("/v1/workers").json()["items"], 60, what="the worker to register")
        response = api.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        first = wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running"
                         and j["placement"] and j, 120, what="the job running")
        [where] = first["placement"]
        [bad] = where["devices"]
        wait_for(lambda: f"up on {GPUS[bad]}" in api.get(f"/v1/jobs/{job_id}/logs").text, 60, what="its rank")

        write_query(stack.fake, lost=bad)  # the GPU falls off the bus
        second = wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["attempt"] == 2
                          and j["status"] == "running" and j["placement"] and j, 120, what="the retry running")
        assert second["placement"][0]["devices"] == [1 - bad]  # the healthy GPU
        attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
        error = attempts[0]["error"]
        assert error["type"] == "device_unhealthy" and f"GPU {bad} ({GPUS[bad]})" in error["message"], attempts
        assert "GPU is lost" in error["message"]
        [worker] = api.get("/v1/workers").json()["items"]
        state = {d["index"]: d for d in worker["devices"]}
        assert state[bad]["state"] == "unhealthy" and "no longer lists it" in state[bad]["reason"], state
        assert state[1 - bad]["state"] == "held"

        # Out of placement: a second job waits, rather than taking the lost GPU.
        other = api.post("/v1/jobs", json={**spec, "name": "waits"}).json()["id"]
        time.sleep(3 * devices.HEALTH_EVERY_S / 2)  # the worker polls the queue many times meanwhile
        assert api.get(f"/v1/jobs/{other}").json()["status"] == "queued"
        write_query(stack.fake, lost=None)  # the GPU is back (reset): it is placed again
        wait_for(lambda: api.get(f"/v1/jobs/{other}").json()["status"] == "running", 120, what="it placed")
        assert api.get(f"/v1/jobs/{other}").json()["placement"][0]["devices"] == [bad]
        for job in (job_id, other):
            assert api.post(f"/v1/jobs/{job}/cancel").status_code == 200
            assert wait_terminal(api, job, timeout=60)["status"] == "cancelled"
