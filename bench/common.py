"""What both benchmarks share: a throwaway stack on SQLite and the local Redis."""

import os
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from service.jobs.status import TERMINAL
from service.settings import Settings
from service.stack import Stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def bench_stack(workers: int = 1, **overrides):
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-") as tmp:
        settings = Settings(data_dir=Path(tmp), redis_url=os.environ.get("TRAINJOBS_REDIS_URL",
                                                                          "redis://127.0.0.1:6379/14"),
                            queue_prefix=f"bench{os.getpid()}", **overrides)
        with Stack(settings, port=free_port(), workers=workers, quiet=True) as stack:
            with httpx.Client(base_url=stack.api_url, timeout=30) as api:
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
