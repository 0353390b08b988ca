"""What the benchmarks share: a throwaway stack (SQLite unless told otherwise) and the local Redis.

Redis: TRAINJOBS_BENCH_REDIS_URL, else TRAINJOBS_TEST_REDIS_URL, else TRAINJOBS_REDIS_URL, else db 14 of the
local one. PostgreSQL (bench/polling.py): TRAINJOBS_BENCH_POSTGRES_URL, else TRAINJOBS_TEST_POSTGRES_URL, else
the tests' default database.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from service.cli.stack import Stack
from service.settings import Settings
from trainjobs import runenv
from trainjobs.states import TERMINAL


def redis_url() -> str:
    for name in ("TRAINJOBS_BENCH_REDIS_URL", "TRAINJOBS_TEST_REDIS_URL", "TRAINJOBS_REDIS_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return "redis://127.0.0.1:6379/14"


def postgres_url() -> str:
    return (os.environ.get("TRAINJOBS_BENCH_POSTGRES_URL") or os.environ.get("TRAINJOBS_TEST_POSTGRES_URL")
            or "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def bench_stack(workers: int = 1, **overrides):
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-") as tmp:
        settings = Settings(data_dir=Path(tmp), redis_url=redis_url(), queue_prefix=f"bench{os.getpid()}",
                            **overrides)
        with Stack(settings, port=free_port(), workers=workers, quiet=True) as stack:
            with stack.client(timeout=30) as api:
                yield stack, api


def wait_job(api: httpx.Client, job_id: str, until=TERMINAL, poll_s: float = 0.1, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in until:
            return job
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout}s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_bare(spec: dict, extra_env: dict[str, str] | None = None) -> tuple[list[dict], float]:
    """A spec under a bare torchrun: the command line and environment the worker would use, without the
    service around it. Returns the reporter's records and the wall time."""
    from trainjobs.spec import JobSpec
    from worker import launch

    job_spec = JobSpec.model_validate(spec)
    with tempfile.TemporaryDirectory(prefix="trainjobs-bare-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "tmp").mkdir()
        (run_dir / runenv.SPEC_FILE).write_text(job_spec.model_dump_json())
        cmd = launch.render(job_spec, job_id="bare", attempt=1, run_dir=run_dir, python=sys.executable,
                            data_dir=run_dir, job_dir=run_dir / "storage", shutdown_grace_s=5,
                            base_env=launch.default_env(), cpu_count=os.cpu_count() or 1)
        cmd.env.update(extra_env or {})
        t0 = time.perf_counter()
        subprocess.run(cmd.argv, env=cmd.env, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, wall
