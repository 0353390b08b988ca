"""A job's own dependencies (entrypoint.requirements, issue 14): a worker with TRAINJOBS_ALLOW_PIP builds a
virtualenv on top of its own, once per machine, and reuses it; pip's failure is the job's, not retried; a
cancel stops pip. The registry package is tomli-w (tiny, pure Python, not among the worker's packages).

Issue 41: the build runs in a sandbox, as the job's uid, reaching only the index. The stack's pip also reads a
local index (tests/test_build_sandbox.py's make_index) of sdists whose in-tree build backends probe the host."""

import fcntl
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from service.settings import Settings
from tests.conftest import REDIS_URL
from tests.helpers import count_jobs, live_stack, wait_for, wait_terminal
from tests.test_build_sandbox import make_index
from trainjobs import Client
from trainjobs.spec import JobSpec, read_requirements
from worker import build_sandbox, environments, inventory, sandbox
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


PROBE_SCRIPT = '''\
import json, hostilepkg
from trainjobs import report, summary

print("FINDINGS " + json.dumps(hostilepkg.FINDINGS), flush=True)
try:
    open(hostilepkg.__file__, "a").close()
    print("ENV writable", flush=True)
except OSError as exc:
    print("ENV", type(exc).__name__, flush=True)
report(step=1, loss=1.0)
summary(ok=True)
'''


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("requirements")
    data = root / "data"
    token = Settings(data_dir=data).admin_token_file
    secrets = token.parent
    ports = [urlsplit(REDIS_URL).port or 6379, urlsplit(postgres_url).port or 5432]
    index = make_index(root / "index", {
        "hostilepkg": {"list": [str(secrets), str(data), str(data / "envs")],
                       "read": [str(token), str(data / "trainjobs.db")], "ports": ports,
                       "through_proxy": [f"127.0.0.1:{p}" for p in ports] + ["example.com:443"]},
        "slowpkg": {"sleep": 120, "ports": [], "read": []}})
    # The workers' pip (its configuration and PIP_* variables, as an operator sets them) gets the local index too.
    before = os.environ.get("PIP_EXTRA_INDEX_URL")
    os.environ["PIP_EXTRA_INDEX_URL"] = f"{build_sandbox.pip_config().get('extra-index-url', '')} {index}".strip()
    try:
        with live_stack(postgres_url, data, name="requirements", allow_entrypoints=True, allow_pip=True) as s:
            (s.settings.data_dir / "scripts").mkdir(exist_ok=True)  # for the jobs that ship no package
            (s.settings.data_dir / "scripts" / "train.py").write_text(SCRIPT)
            (s.settings.data_dir / "scripts" / "probe.py").write_text(PROBE_SCRIPT)
            yield s
    finally:
        if before is None:
            os.environ.pop("PIP_EXTRA_INDEX_URL", None)
        else:
            os.environ["PIP_EXTRA_INDEX_URL"] = before


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


def test_cancel_while_pip_builds_stops_the_build_and_cancels_the_job(stack, tmp_path):
    """And while pip runs, the starting job says so. slowpkg's build backend sleeps in the sandbox."""
    spec = {"name": "slow-dep", "entrypoint": {"script": "train.py", "requirements": ["slowpkg"]}}
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
        time.sleep(1)  # the backend is building
        asked = time.monotonic()
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        job = wait_terminal(api, job_id, timeout=30)
        took = time.monotonic() - asked
    assert job["status"] == "cancelled" and took < 15, (job["status"], took)
    assert not [p for p in pip if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not pip_processes(envs)


def test_a_hostile_build_backend_runs_as_the_jobs_uid_reads_nothing_and_reaches_only_the_index(stack):
    """hostilepkg's in-tree backend, run by pip while it builds the sdist, probes the host: the secrets dir, the
    data dir, the test Redis and PostgreSQL on 127.0.0.1, directly and through the build's proxy. The job that
    imports it prints what it found; its env is read-only to it; the next job of the same list reuses the env."""
    spec = {"name": "hostile-build", "entrypoint": {"script": "probe.py", "requirements": ["hostilepkg"]}}
    data = stack.settings.data_dir
    with stack.client() as api:
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        job = wait_terminal(api, job_id, timeout=180)
        log = api.get(f"/v1/jobs/{job_id}/logs").text
        assert job["status"] == "succeeded", (job["error"], log)
        again = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"], timeout=120)
        again_log = api.get(f"/v1/jobs/{again['id']}/logs").text
    found = json.loads(log.split("FINDINGS ", 1)[1].splitlines()[0])
    if os.geteuid() == 0:  # a root worker: the build ran as the job's own uid
        assert found["uid"] == sandbox.job_uid(stack.settings, job_id) != 0, found
    assert stack.settings.admin_token_file.is_file()  # there on the host, holding the admin's token
    assert found[f"read {stack.settings.admin_token_file}"] == "FileNotFoundError", found
    assert found[f"list {stack.settings.resolved_secrets_dir}"] == "FileNotFoundError", found
    assert found[f"list {data}"] == ["envs"], found  # the data dir holds only the env being built
    assert len(found[f"list {data / 'envs'}"]) == 1, found
    assert found[f"read {data / 'trainjobs.db'}"] == "FileNotFoundError", found
    connects = {k: v for k, v in found.items() if k.startswith("connect ")}
    assert len(connects) == 2 and "connected" not in connects.values(), found
    through = {k: v for k, v in found.items() if k.startswith("proxy ")}
    assert len(through) == 3 and all(v.startswith("HTTP/1.1 403") for v in through.values()), found
    assert "the build's proxy refused CONNECT 127.0.0.1:" in log and "not the package index" in log
    assert "ENV PermissionError" in log or "ENV OSError" in log, log  # the built env is read-only to the job
    assert again["status"] == "succeeded" and "reusing environment" in again_log and "FINDINGS" in again_log


def test_a_direct_url_requirement_is_refused_at_submission_naming_the_field(stack):
    spec = {"entrypoint": {"script": "t.py", "requirements": [
        "tomli-w==1.0.0", "evil @ https://evil.example/evil-0.1.tar.gz"]}}
    with stack.client() as api:
        response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "entrypoint.requirements[1]"
    assert "direct URL reference" in response.json()["detail"] and "TRAINJOBS_ALLOW_DIRECT_URLS" in response.text


def test_requirements_are_checked_at_submission(stack, postgres_url):
    bad = [(["-e /etc"], "pip options are not allowed"), (["--index-url=http://x"], "pip options"),
           (["pkg @ file:///etc/passwd"], "http(s) URL"), (["not a requirement!"], "not a valid requirement"),
           (["x"] * 201, "at most 200"), ("requirements.txt", "needs entrypoint.package"),
           ("../outside.txt", "relative path inside the package"), (["-f /opt"], "pip options"),
           (["--extra-index-url https://x"], "pip options"), (["https://x.example/p-1.0.tar.gz"], "not a valid"),
           (["./pkg"], "not a valid"), (["pkg @ https://x.example/p-1.0.tar.gz"], "direct URL reference")]
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
