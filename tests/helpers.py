"""Shared helpers for tests that run real jobs."""

import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import create_engine, func, insert, select

from service.jobs.models import Job
from service.jobs.queue import PRIORITIES, get_queue
from trainjobs import runenv
from trainjobs.runenv import RUN_TAG_ENV
from trainjobs.states import TERMINAL
from worker import launch


def insert_old_job(db, priority: str = "normal") -> str:
    """A queued job's row of the columns every revision since 0003 has (so not 0011's version): Core, not the
    ORM, whose row has every column of the newest revision. For tests that migrate a database holding jobs."""
    from service.db import utcnow
    from service.jobs import service as jobs
    from tests.conftest import mlp_spec
    from trainjobs.paths import new_job_id
    from trainjobs.spec import JobSpec

    spec = JobSpec.model_validate(mlp_spec(priority=priority))
    job_id = new_job_id()
    db.execute(insert(Job.__table__).values(id=job_id, name=spec.name, spec=spec, spec_hash=jobs.hash_spec(spec),
                                            status="queued", priority=spec.priority, created_at=utcnow()))
    return job_id


def count_jobs(url: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        n = conn.scalar(select(func.count()).select_from(Job))
    engine.dispose()
    return n


@contextmanager
def live_stack(postgres_url: str, data_dir: Path, *, name: str, workers: int = 1, join: bool | None = None,
               api_workers: int = 1, registry: str | None = None, **overrides):
    """A real API and real workers on PostgreSQL and the test Redis, with quick supervision settings; `join`:
    whether its workers join the API with no database URL (None: as `trainjobs up` does)."""
    from service.cli.stack import JOIN, Stack
    from service.settings import Settings
    from tests.conftest import QUEUE_PREFIX, REDIS_URL, _empty_tables

    _empty_tables(postgres_url)
    # NOTE: one job at a time per worker unless a test says otherwise (worker_max_jobs): most tests count workers,
    # and tests/test_shared_workers.py runs several jobs on one.
    settings = Settings(**{"data_dir": data_dir, "database_url": postgres_url, "redis_url": REDIS_URL,
                           "queue_prefix": f"{QUEUE_PREFIX}{name}", "cancel_grace_s": 3, "poll_s": 0.2,
                           "worker_max_jobs": 1, **overrides})
    with Stack(settings, port=free_port(), workers=workers, join=JOIN if join is None else join,
               api_workers=api_workers, registry=registry) as stack:
        yield stack


def stack_cli(stack, *, cwd: Path, config: Path, timeout: float = 240):
    """`trainjobs ARGV` as a user runs it in `cwd` against `stack` (its URL and token in the environment, its own
    config file, a wide terminal): a function of argv to the finished process."""
    import os

    env = {**os.environ, "TRAINJOBS_API_URL": stack.api_url, "TRAINJOBS_TOKEN": stack.token,
           "TRAINJOBS_CONFIG": str(config), "COLUMNS": "160"}

    def trainjobs(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "service.cli", *argv], env=env, cwd=cwd, text=True,
                              capture_output=True, timeout=timeout)
    return trainjobs


def module_stack(name: str, *, worker_args: list[str] | None = None, **overrides):
    """A module-scoped `stack` fixture: one live API (and `workers`, with `worker_args`) for every test of a
    module; conftest's `api` fixture is a client on it. Usage: `stack = module_stack("e2e", lease_s=3)`."""

    @pytest.fixture(scope="module")
    def stack(postgres_url, tmp_path_factory):
        settings = dict(overrides)
        workers = settings.pop("workers", 1)
        with live_stack(postgres_url, tmp_path_factory.mktemp(name), name=name,
                        workers=0 if worker_args else workers, **settings) as s:
            if worker_args:
                s.add_workers(workers, args=worker_args)
            yield s

    return stack


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


def run_torchrun(spec: dict, run_dir: Path, *, attempt: int = 1, job_dir: Path | None = None,
                 check: bool = True) -> list[dict]:
    """Run the training runtime under torchrun without the service; returns its reporter records.

    job_dir (checkpoints, artifacts) defaults to run_dir/storage; pass the same one to resume.
    """
    from trainjobs.spec import JobSpec

    job_spec = JobSpec.model_validate(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tmp").mkdir(exist_ok=True)
    (run_dir / runenv.SPEC_FILE).write_text(job_spec.model_dump_json())
    # The service's own command line; cpu_count=nproc gives each rank one thread, as on a busy CI box.
    plan = launch.render(job_spec, job_id="bare", attempt=attempt, run_dir=run_dir, python=sys.executable,
                         data_dir=run_dir, job_dir=job_dir or run_dir / "storage", shutdown_grace_s=5,
                         base_env=launch.default_env(), cpu_count=job_spec.resources.nproc_per_node)
    done = subprocess.run(plan.argv, env=plan.env, capture_output=True, timeout=180)
    if check and done.returncode != 0:
        raise AssertionError(f"torchrun exited {done.returncode}:\n{done.stdout.decode()[-4000:]}")
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def queued_ids(redis, prefix: str) -> list[str]:
    """Every job id on the RQ queues of a prefix; an id enqueued twice appears twice."""
    return [i for p in PRIORITIES for i in get_queue(redis, prefix, p).get_job_ids()]


class Receiver:
    """A webhook receiver on 127.0.0.1 (a free port): records every request, answers `status` (settable)."""

    def __init__(self, status: int = 200):
        import http.server
        import threading

        self.status, self.requests, self.lock = status, [], threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    status = receiver.status
                    receiver.requests.append({"headers": dict(self.headers), "body": body, "status": status,
                                              "path": self.path})
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def delivered(self) -> list[dict]:
        """The requests answered with a 2xx, each with its parsed body as `json`, in arrival order."""
        with self.lock:
            return [{**r, "json": json.loads(r["body"])} for r in self.requests if 200 <= r["status"] < 300]
