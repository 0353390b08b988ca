"""Shared helpers for tests that run real jobs."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from worker.launch import RUN_TAG_ENV

TERMINAL = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_terminal(api: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    def done():
        job = api.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] in TERMINAL else None

    return wait_for(done, timeout, what=f"job {job_id} to end")


def processes_of(job_id: str) -> list[psutil.Process]:
    """Every live process whose environment carries the job's run tag (any attempt)."""
    found = []
    prefix = f"{RUN_TAG_ENV}={job_id}.".encode()
    for proc in psutil.process_iter():
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if any(v.startswith(prefix) for v in f.read().split(b"\0")):
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        found.append(proc)
        except (OSError, psutil.NoSuchProcess):
            continue
    return found


def run_torchrun(spec: dict, run_dir: Path, nproc: int) -> list[dict]:
    """Run the training runtime under a bare torchrun; returns its reporter records."""
    from service.jobs.spec import JobSpec

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tmp").mkdir(exist_ok=True)
    (run_dir / "spec.json").write_text(JobSpec.model_validate(spec).model_dump_json())
    env = dict(os.environ, TMPDIR=str(run_dir / "tmp"), TRAINJOBS_METRICS_FILE=str(run_dir / "metrics.jsonl"),
               OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                    "--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", "worker.train", str(run_dir)],
                   env=env, check=True, capture_output=True, timeout=180)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
