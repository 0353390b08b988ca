"""Cancel stops every process of an attempt, also those that left torchrun's tree without the run tag
(issue 13, item 11): a helper started with an empty environment that ignores SIGTERM and holds the output
pipe, and a double-forked one in a session of its own. Neither survives the cancel, and the job settles
within the grace (it used to wait 10 s on the pipe they held, without renewing its lease)."""

import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for, wait_terminal

GRACE_S = 2

# Rank 0 starts two helpers that escape the ways a user's code does, then trains until it is cancelled.
ESCAPING = '''\
import os, subprocess, sys, time
pids = os.environ["TRAINJOBS_ARTIFACTS_DIR"]  # the job's own: the sandbox lets it write nowhere else
if os.environ["RANK"] == "0":
    stubborn = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); "
                "print('helper up', flush=True); time.sleep(600)")
    # (a) no run tag (an environment of its own), ignores SIGTERM, holds our stdout (the output pipe)
    subprocess.Popen([sys.executable, "-c", stubborn, os.path.join(pids, "tagless")], env={})
    # (b) a double fork into a session of its own: its parent exits at once, so it leaves torchrun's tree
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execve(sys.executable, [sys.executable, "-c", stubborn, os.path.join(pids, "detached")], {})
        os._exit(0)
    os.wait()
while True:
    time.sleep(0.1)
'''


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    scripts = tmp_path_factory.mktemp("escape-scripts")
    (scripts / "escaping.py").write_text(ESCAPING)
    with live_stack(postgres_url, tmp_path_factory.mktemp("escape"), name="escape", allow_entrypoints=True,
                    scripts_dir=scripts, cancel_grace_s=GRACE_S) as s:
        yield s


def helper_pids(stack, job_id: str) -> list[int]:
    """The helpers' pids as the worker sees them (not the sandbox's): found by the pid files they name."""
    artifacts = stack.settings.resolved_storage_dir / "jobs" / job_id / "artifacts"
    names = [str(artifacts / "tagless"), str(artifacts / "detached")]
    if not all(Path(n).exists() and Path(n).read_text() for n in names):
        return []
    return [p.pid for p in psutil.process_iter(["cmdline"]) if set(p.info["cmdline"] or []) & set(names)
            and alive(p.pid)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_stops_helpers_that_left_the_tree_without_the_run_tag_and_settles_within_the_grace(stack):
    with stack.client(timeout=10) as api:
        spec = mlp_spec(model=None, data=None, entrypoint={"script": "escaping.py"})
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        helpers = wait_for(lambda: len(found := helper_pids(stack, job_id)) == 2 and found, 60,
                           what="both helpers to start")
        try:
            assert all(alive(pid) for pid in helpers)
            asked = time.monotonic()
            assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            job = wait_terminal(api, job_id, timeout=60)
            settled_s = time.monotonic() - asked
            print(f"cancel with two escaped helpers: settled in {settled_s:.1f}s (grace {GRACE_S}s)")
            assert job["status"] == "cancelled"
            wait_for(lambda: not any(alive(pid) for pid in helpers), 5, 0.1, what="the helpers to be gone")
            assert settled_s < GRACE_S + 5  # not the 10 s (and more) of waiting on a pipe a survivor held
            assert "helper up" in api.get(f"/v1/jobs/{job_id}/logs").text  # their output was shipped
        finally:
            for pid in helpers:  # never leave them behind, whatever failed
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass


def test_a_run_that_ends_by_itself_leaves_no_helper_behind(stack):
    """The same escape from a run that is not cancelled: when the ranks end, what they left is stopped."""
    script = Path(stack.settings.resolved_scripts_dir) / "leaves.py"
    ends = ("while not all(os.path.exists(os.path.join(pids, n)) for n in ('tagless', 'detached')):\n"
            "    time.sleep(0.05)\n"
            "print('rank done', flush=True)\n")
    script.write_text(ESCAPING.replace("while True:\n    time.sleep(0.1)\n", ends))
    with stack.client(timeout=10) as api:
        spec = mlp_spec(model=None, data=None, entrypoint={"script": "leaves.py"})
        spec["resources"]["nproc_per_node"] = 1
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        helpers: list[int] = []
        wait_for(lambda: helpers.extend(helper_pids(stack, job_id)) or len(helpers) >= 2 or
                 api.get(f"/v1/jobs/{job_id}").json()["status"] in ("succeeded", "failed"), 60, 0.05,
                 what="both helpers to start")
        job = wait_terminal(api, job_id, timeout=60)
        artifacts = stack.settings.resolved_storage_dir / "jobs" / job_id / "artifacts"
        try:
            assert job["status"] == "succeeded", job["error"]
            assert (artifacts / "tagless").exists() and (artifacts / "detached").exists()
            wait_for(lambda: not helper_pids(stack, job_id), 5, 0.1, what="the helpers to be gone")
        finally:
            for pid in helpers:
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
