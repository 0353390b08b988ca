"""A job's own dependencies (entrypoint.requirements, issue 14): a worker with TRAINJOBS_ALLOW_PIP builds a
virtualenv on top of its own, once per machine, and reuses it; pip's failure is the job's, not retried; a
cancel stops pip. The registry package is tomli-w (tiny, pure Python, not among the worker's packages)."""

import fcntl
import http.server
import json
import os
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import count_jobs, live_stack, wait_for, wait_terminal
from trainjobs import Client
from trainjobs.spec import JobSpec, read_requirements
from worker import environments, inventory
from worker import packages as worker_packages

SCRIPT = '''\
import os, sys
import tomli_w
import torch
from trainjobs import report, summary

print("tomli_w from", tomli_w.__file__, flush=True)
print("torch from", torch.__file__, flush=True)
print("python", sys.executable, flush=True)
print(tomli_w.dumps({"who": os.environ.get("WHO", "?")}), flush=True)
report(step=1, loss=1.0)
summary(ok=True)
'''


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("requirements"), name="requirements",
                    allow_entrypoints=True, allow_pip=True) as s:
        (s.settings.data_dir / "scripts").mkdir(exist_ok=True)  # for the jobs that ship no package
        (s.settings.data_dir / "scripts" / "train.py").write_text(SCRIPT)
        yield s


def pip_processes(root: Path) -> list[psutil.Process]:
    """The pip processes that install into an environment under `root`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "pip" in cmdline and "install" in cmdline and str(root) in " ".join(cmdline):
            found.append(proc)
    return found


def project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(SCRIPT)
    (root / "requirements.txt").write_text("# what train.py needs beyond the worker's torch\ntomli-w==1.0.0\n")
    return root


def cli(stack, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token,
               XDG_CACHE_HOME=str(cwd.parent / "cache"))
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def test_a_job_installs_its_requirements_once_and_the_next_job_reuses_them(stack, tmp_path, monkeypatch):
    folder = project(tmp_path / "needs-tomli")
    dry = cli(stack, folder, "run", "--requirements", "requirements.txt", "--dry-run", "--", "train.py")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["entrypoint"]["requirements"] == ["tomli-w==1.0.0"]

    first = cli(stack, folder, "run", "--requirements", "requirements.txt", "--env", "WHO=first", "--follow",
                "--json", "--", "train.py")
    assert first.returncode == 0, first.stdout + first.stderr
    job = json.loads(first.stdout)
    assert job["status"] == "succeeded", job["error"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with Client(stack.api_url, token=stack.token) as c:
        log = c.logs(job["id"])
        assert "[trainjobs] requirements: building environment" in log and "Successfully installed tomli-w" in log
        assert 'who = "first"' in log  # the script imported the package pip installed
        env_root = str((stack.settings.data_dir / "envs").resolve())
        assert f"tomli_w from {env_root}" in log
        assert f"python {env_root}" in log
        assert f"torch from {sysconfig.get_path('purelib')}" in log  # the worker's torch, not another build

        # The same list, this time named by file in the package: the same environment, not built again.
        digest = c.upload_package(folder)
        second = c.wait(c.submit({"name": "again", "env": {"WHO": "second"}, "entrypoint": {
            "package": digest, "script": "train.py", "requirements": "requirements.txt"}})["id"], timeout=120)
        assert second["status"] == "succeeded", second["error"]
        log = c.logs(second["id"])
        assert "[trainjobs] requirements: reusing environment" in log and "nothing to install" in log
        assert "building environment" not in log and "Successfully installed" not in log
        assert 'who = "second"' in log
    with stack.client() as api:
        [worker] = api.get("/v1/workers").json()["items"]
    assert worker["labels"]["trainjobs.io/pip"] == "true"  # what the dispatcher and the 422 look for


def test_a_requirement_pip_cannot_find_fails_the_job_with_pips_words_and_no_retry(stack):
    spec = {"name": "missing-dep", "max_retries": 2, "entrypoint": {
        "script": "train.py", "requirements": ["trainjobs-no-such-package-for-tests==0.0.1"]}}
    with stack.client() as api:
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        job = wait_terminal(api, job_id, timeout=120)
        attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
        log = api.get(f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "failed"
    assert job["error"]["type"] == "requirements_failed"
    assert "No matching distribution found for trainjobs-no-such-package-for-tests==0.0.1" in job["error"]["message"]
    assert len(attempts) == 1  # pip answers the same list the same way: max_retries is not spent on it
    assert "ERROR: No matching distribution found" in log


class _SlowIndex(http.server.BaseHTTPRequestHandler):
    """Answers nothing for a long while: a pip download that never ends by itself."""

    def do_GET(self):  # noqa: N802 - http.server's name
        time.sleep(60)

    def log_message(self, *args):
        pass


def test_cancel_while_pip_installs_stops_pip_and_cancels_the_job(stack, tmp_path):
    """And while pip runs, the starting job says so."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _SlowIndex)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}/slowpkg-1.0-py3-none-any.whl"
    spec = {"name": "slow-dep", "entrypoint": {"script": "train.py", "requirements": [f"slowpkg @ {url}"]}}
    try:
        with stack.client() as api:
            job_id = api.post("/v1/jobs", json=spec).json()["id"]
            wait_for(lambda: "building environment" in api.get(f"/v1/jobs/{job_id}/logs").text, 60,
                     what="the build to start")
            envs = (stack.settings.data_dir / "envs").resolve()
            pip = wait_for(lambda: pip_processes(envs), 30, what="pip to run")
            # What the starting job does is said where a user looks: the API, and `trainjobs status`.
            job = api.get(f"/v1/jobs/{job_id}").json()
            assert (job["status"], job["pending_reason"]) == ("starting", "installing 1 requirement(s)"), job
            shown = cli(stack, tmp_path, "status", job_id)
            assert "starting" in shown.stdout and "installing 1 requirement(s)" in shown.stdout, shown.stdout
            time.sleep(1)  # pip is downloading from the index that never answers
            asked = time.monotonic()
            assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            job = wait_terminal(api, job_id, timeout=30)
            took = time.monotonic() - asked
    finally:
        server.shutdown()
    assert job["status"] == "cancelled" and took < 15, (job["status"], took)
    assert not [p for p in pip if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_requirements_are_checked_at_submission(stack, postgres_url):
    bad = [(["-e /etc"], "pip options are not allowed"), (["--index-url=http://x"], "pip options"),
           (["pkg @ file:///etc/passwd"], "http(s) URL"), (["not a requirement!"], "not a valid requirement"),
           (["x"] * 201, "at most 200"), ("requirements.txt", "needs entrypoint.package"),
           ("../outside.txt", "relative path inside the package")]
    with stack.client() as api:
        before = count_jobs(postgres_url)
        for requirements, says in bad:
            spec = {"entrypoint": {"script": "t.py", "requirements": requirements}}
            response = api.post("/v1/jobs", json=spec)
            assert response.status_code == 422 and says in response.text, (requirements, response.text)
            assert "requirements" in response.text
        assert count_jobs(postgres_url) == before


def test_only_the_worker_sets_its_capability_labels():
    with pytest.raises(ValueError, match="trainjobs.io/"):
        inventory.parse_labels("zone=a,trainjobs.io/pip=true")


def test_requirements_files_are_read_as_pip_reads_them():
    text = "# a comment\n\ntomli-w==1.0.0  # pinned\nnumpy>=1.26 \\\n  ,<3\n"
    assert read_requirements(text) == ["tomli-w==1.0.0", "numpy>=1.26  ,<3"]
    spec = JobSpec.model_validate({"entrypoint": {"script": "t.py", "requirements": read_requirements(text)}})
    assert spec.entrypoint.requirements == ["tomli-w==1.0.0", "numpy>=1.26  ,<3"]


def test_an_environment_an_attempt_holds_is_never_evicted(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_packages, "EVICT_GRACE_S", 0.0)
    cache = environments.EnvCache(tmp_path, max_bytes=0)
    for key in ("held", "idle"):
        (tmp_path / key).mkdir()
        (tmp_path / f"{key}.bytes").write_text("100")
        (tmp_path / f"{key}.used").touch()
    fd = os.open(tmp_path / "held.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as a running attempt's Env does until release()
    try:
        assert cache.evict() == ["idle"]
    finally:
        os.close(fd)
    assert (tmp_path / "held").is_dir() and not (tmp_path / "idle").exists()
    assert cache.evict() == ["held"] and not (tmp_path / "held").exists()
