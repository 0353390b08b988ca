"""Hostile jobs, each run as a real job through a real worker on the embedded stack (SQLite, the secrets dir
beside the data dir), each asserting what it was refused and that it, its worker and the job it attacks are
not harmed. The scripts are tests/hostile/: hostile.py prints one RESULT line per attempt.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from service.cli.stack import Stack
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL
from tests.helpers import free_port, processes_of, wait_for, wait_terminal
from worker import sandbox
from worker.launch import USER_MAIN

HOSTILE = Path(__file__).with_name("hostile")
PIDS_MAX = 256
MEMORY = 768 * 2**20  # torchrun itself holds ~300 MiB of it
pytestmark = pytest.mark.skipif(sandbox.detect(Settings()).bwrap is None, reason="no sandbox on this machine")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox")
    scripts = root / "scripts"
    shutil.copytree(HOSTILE, scripts)
    settings = Settings(data_dir=root / "data", redis_url=REDIS_URL, queue_prefix=f"{QUEUE_PREFIX}sbx",
                        allow_entrypoints=True, scripts_dir=scripts, poll_s=0.2, cancel_grace_s=2,
                        job_pids_max=PIDS_MAX, job_memory_bytes=MEMORY)
    with Stack(settings, port=free_port(), workers=2, quiet=True) as s:
        yield s


@pytest.fixture(scope="module")
def standin_gpu():
    """A device node as an unassigned GPU's would be (a copy of /dev/null's: harmless if opened)."""
    path = Path(f"/dev/tj-standin-gpu-{os.getpid()}")
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
    yield path
    path.unlink()


def submit(api, script: str, *args: str, target: dict | None = None) -> str:
    spec = {"name": f"hostile-{args[0] if args else script}", "resources": {"nproc_per_node": 1, "device": "cpu"},
            "entrypoint": {"script": script, "args": list(args)}, "env": {"TARGET": json.dumps(target or {})},
            "timeout_s": 120}
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def run(stack, probe: str, target: dict | None = None) -> tuple[dict, str, dict[str, tuple[str, str]]]:
    """Run hostile.py PROBE as a job; its end state, its logs and {attempt: (allowed|refused, detail)}."""
    with stack.client(timeout=10) as api:
        job = wait_terminal(api, submit(api, "hostile.py", probe, target=target))
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
    results = {}
    for line in logs.splitlines():
        if line.startswith("RESULT "):
            _, name, verdict, *detail = line.split(" ", 3)
            results[name] = (verdict, " ".join(detail))
    return job, logs, results


@pytest.fixture(scope="module")
def victim(stack):
    """Another user's job, running meanwhile on the other worker: its checkpoint, its artifact, its rank's pid."""
    with stack.client(timeout=10) as api:
        job_id = submit(api, "victim.py")
        wait_for(lambda: "victim ready" in api.get(f"/v1/jobs/{job_id}/logs").text, 60, what="the victim to start")
    found = [p.cmdline() for p in processes_of(job_id)]
    [rank] = [p for p in processes_of(job_id) if str(USER_MAIN) in p.cmdline() and "torch.distributed.run" not in
              p.cmdline() and Path(p.cmdline()[0]).name not in ("bwrap", "setpriv")] or [found]
    job_dir = stack.settings.resolved_storage_dir / "jobs" / job_id
    yield {"id": job_id, "pid": rank.pid, "checkpoints": job_dir / "checkpoints", "artifacts": job_dir / "artifacts"}
    (job_dir / "checkpoints" / "stop").touch()
    with stack.client(timeout=10) as api:
        job = wait_terminal(api, job_id)
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "succeeded", logs
    assert "victim sees ['model.pt', 'stop']" in logs  # nothing planted


def refused(results: dict, *names: str) -> None:
    for name in names:
        verdict, detail = results[name]
        assert verdict == "refused", f"{name} was allowed: {detail}"


def test_a_job_pushes_nothing_onto_any_queue_and_no_forged_entry_runs(stack, tmp_path):
    proof = tmp_path / "pwned"
    password_less = REDIS_URL.split("@")[-1] if "@" in REDIS_URL else REDIS_URL
    queues = [f"{stack.settings.queue_prefix}-{p}" for p in ("gang", "high", "normal", "low")]
    job, logs, results = run(stack, "queue", {"redis": f"redis://{password_less.removeprefix('redis://')}",
                                              "queues": queues, "proof": str(proof)})
    assert job["status"] == "succeeded", logs
    assert len(results) == 8 and all(verdict == "refused" for verdict, _ in results.values()), results
    assert not proof.exists()


def test_a_job_reaches_no_secret_no_database_and_no_other_jobs_files(stack, victim):
    settings = stack.settings
    home_secret = Path.home() / f".trainjobs-test-secret-{os.getpid()}"
    home_secret.write_text("the worker's own")
    try:
        job, logs, results = run(stack, "files", {
            "secrets": str(settings.resolved_secrets_dir), "database": str(settings.data_dir / "trainjobs.db"),
            "neighbour_checkpoints": str(victim["checkpoints"]), "neighbour_artifacts": str(victim["artifacts"]),
            "runs": str(settings.runs_dir.resolve()), "package_cache": str(settings.data_dir / "package-cache"),
            "data_dir": str(settings.data_dir.resolve()), "scripts": str(settings.resolved_scripts_dir),
            "home": str(Path.home())})
    finally:
        home_secret.unlink()
    assert job["status"] == "succeeded", logs
    assert (settings.resolved_secrets_dir / "admin.token").is_file() and (settings.data_dir / "trainjobs.db").is_file()
    refused(results, "read-secrets", "read-admin-token", "read-database", "write-database",
            "read-neighbour-checkpoint", "list-neighbour-artifacts", "plant-neighbour-checkpoint",
            "list-package-cache", "write-data-dir", "write-scripts", "write-venv", "write-usr", "write-etc",
            "write-owner")
    assert victim["id"] not in results["list-runs"][1]  # its own run dir alone
    assert home_secret.name not in results["read-worker-home"][1]
    assert all(results[n][0] == "allowed" for n in ("own-checkpoint", "own-artifact", "own-tmp", "own-shm")), results
    assert not (victim["checkpoints"] / "planted.pt").exists()


def test_a_job_sees_no_other_process_no_worker_environment_no_unassigned_device(stack, victim, standin_gpu):
    worker_pid = next(p.pid for p in psutil.process_iter(["cmdline"]) if "worker.main" in " ".join(p.info["cmdline"]
                                                                                               or []))
    job, logs, results = run(stack, "procs", {"neighbour_pid": victim["pid"], "worker_pid": worker_pid,
                                              "device": str(standin_gpu), "api_port": stack.port})
    assert job["status"] == "succeeded", logs
    refused(results, "see-neighbour", "signal-neighbour", "ptrace-neighbour", "read-worker-environ",
            "open-standin-gpu", "reach-api")
    assert results["open-dev-null"][0] == "allowed"
    assert int(results["count-processes"][1]) < 10, results["count-processes"]  # bwrap's init, torchrun, the rank
    assert "TRAINJOBS_DATABASE_URL" not in logs and "trainjobs.db" not in results["read-pid1-environ"][1]
    assert psutil.pid_exists(victim["pid"])


def test_a_double_forked_daemon_is_gone_when_its_job_ends(stack):
    marker = f"tj-daemon-{os.getpid()}"
    job, logs, results = run(stack, "daemon", {"marker": marker})
    assert job["status"] == "succeeded", logs

    def left():
        return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    wait_for(lambda: not left(), 10, what="the daemon to be gone")


def test_nothing_of_a_job_outlives_its_work_horse_killed_with_sigkill(stack):
    marker = f"tj-orphan-{os.getpid()}"
    with stack.client(timeout=10) as api:
        job_id = submit(api, "hostile.py", "linger", target={"marker": marker})
        wait_for(lambda: left(marker), 60, what="the job's daemon to start")
        supervisor_of(job_id).kill()
        wait_for(lambda: not left(marker) and not processes_of(job_id), 15, what="every process of the job to end")
        api.post(f"/v1/jobs/{job_id}/cancel")  # not retried: the next tests want both workers


def left(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def supervisor_of(job_id: str) -> psutil.Process:
    """The RQ work-horse supervising the job: the parent of its sandbox's bwrap."""
    [bwrap] = [p for p in processes_of(job_id) if Path(p.cmdline()[0]).name == "bwrap" and p.parent().name() != "bwrap"]
    return bwrap.parent()


def test_a_fork_bomb_is_bounded_and_its_worker_runs_the_next_job(stack):
    job, logs, results = run(stack, "forkbomb")
    verdict, detail = results["forkbomb"]
    assert verdict == "refused" and int(detail.split()[1].rstrip(":")) < PIDS_MAX, detail
    assert job["status"] == "succeeded", logs
    wait_for(lambda: not processes_of(job["id"]), 10, what="the bomb's processes to be gone")
    after, logs, _ = run(stack, "daemon", {"marker": "after-the-bomb"})
    assert after["status"] == "succeeded", logs


def test_a_job_that_fills_memory_is_killed_alone_at_its_bound(stack):
    job, logs, results = run(stack, "memory")
    assert job["status"] == "failed" and "memory" not in results, logs
    assert "memory bound" in logs
    after, logs, _ = run(stack, "daemon", {"marker": "after-the-hoard"})
    assert after["status"] == "succeeded", logs


def test_a_worker_that_is_not_root_sandboxes_its_job_in_a_user_namespace(tmp_path):
    """The same sandbox for a worker of an ordinary uid: namespaces without root, the job as the worker's uid."""
    if os.geteuid() != 0:
        pytest.skip("the test drops from root to nobody")
    root = Path(tempfile.mkdtemp(prefix="tj-nonroot-", dir="/tmp"))
    try:
        root.chmod(0o755)
        for sub in ("data/runs/j/attempt-1", "data/storage/jobs/j/checkpoints", "data/storage/jobs/j/artifacts",
                    "data/runs/other/attempt-1", "data/scripts"):
            (root / sub).mkdir(parents=True)
        (root / "data/trainjobs.db").write_text("sqlite")
        subprocess.run(["chown", "-R", "65534:65534", str(root)], check=True)
        code = (
            "import subprocess; from pathlib import Path; from service.settings import Settings; from worker import "
            "sandbox\n"
            f"s = Settings(data_dir='{root}/data')\n"
            "support = sandbox.detect(s); assert support.on and not support.own_uid, support\n"
            f"a = sandbox.Attempt(job_id='0123456789abcdef0123', run_dir=Path('{root}/data/runs/j/attempt-1'), "
            f"job_dir=Path('{root}/data/storage/jobs/j'), python='{sys.executable}', data_dir=Path('{root}/data'), "
            f"scripts_dir=Path('{root}/data/scripts'))\n"
            f"probe = 'id -u; ls {root}/data/runs; ls /proc | grep -c [0-9]; cat {root}/data/trainjobs.db; "
            f"touch {root}/data/storage/jobs/j/checkpoints/mine && echo wrote'\n"
            "subprocess.run(sandbox.command(support, s, a, ['/bin/sh', '-c', probe]), check=False)\n")
        done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
                               "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
        lines = done.stdout.split()
        assert done.returncode == 0, done.stderr
        assert lines[0] == "65534" and lines[1] == "j" and "other" not in lines  # its own run dir alone
        assert int(lines[2]) < 5 and "sqlite" not in done.stdout and lines[-1] == "wrote", done.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_worker_that_allows_users_code_and_cannot_sandbox_refuses_to_start(tmp_path):
    env = {**os.environ, "PATH": "/nonexistent", "TRAINJOBS_ALLOW_ENTRYPOINTS": "1",
           "TRAINJOBS_DATA_DIR": str(tmp_path / "data"), "TRAINJOBS_REDIS_URL": REDIS_URL}
    done = subprocess.run([sys.executable, "-m", "worker.main", "--burst"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[1])
    assert done.returncode != 0 and "bubblewrap" in done.stderr and "TRAINJOBS_SANDBOX=off" in done.stderr


def test_the_workers_say_what_they_enforce_and_a_job_may_require_the_sandbox(stack):
    with stack.client(timeout=10) as api:
        workers = api.get("/v1/workers").json()["items"]
        response = api.post("/v1/jobs", json={"name": "needs-sandbox", "resources": {
            "nproc_per_node": 1, "device": "cpu", "selector": {"trainjobs.io/sandbox": "on"}}, "entrypoint": {
            "script": "hostile.py", "args": ["daemon"]}, "env": {"TARGET": json.dumps({"marker": "required"})}})
        job = wait_terminal(api, response.json()["id"])
    root = os.geteuid() == 0
    assert len(workers) == 2
    for worker in workers:
        labels = worker["labels"]
        assert labels["trainjobs.io/sandbox"] == "on" and labels["trainjobs.io/sandbox-net"] == "private"
        assert labels["trainjobs.io/sandbox-uid"] == ("own" if root else "worker's")
        assert labels["trainjobs.io/sandbox-cgroup"] in ("v1", "v2", "none")
        assert labels["trainjobs.io/redis-auth"] in ("password", "none")
    assert job["status"] == "succeeded"


def test_an_attempts_cgroup_left_by_a_killed_work_horse_is_swept_and_a_live_ones_kept():
    from worker import cgroups

    if sandbox.detect(Settings()).cgroup is None:
        pytest.skip("this worker cannot make cgroups")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(gone.stdout), os.getpid()
    stale, live = cgroups.Attempt(f"tj-test-stale-{dead_pid}"), cgroups.Attempt(f"tj-test-live-{live_pid}")
    try:
        for group in (stale, live):
            group.create(memory_bytes=2**30, pids_max=64)
        removed = cgroups.sweep_stale()
        assert stale.name in removed and not any(d.exists() for d in stale.dirs)
        assert live.name not in removed and all(d.exists() for d in live.dirs)
    finally:
        stale.remove()
        live.remove()


# --- The root worker reaches a job's files by descriptor, never through what the job planted (issue 41) ---

def plant(stack, what: str, to: str = "", **spec) -> tuple[dict, str]:
    """A job of hostile.py that plants `what` (pointing at `to`), then ends; its end state and logs."""
    with stack.client(timeout=10) as api:
        job_id = submit_spec(api, "plant", {"plant": what, "to": to}, **spec)
        return wait_terminal(api, job_id), api.get(f"/v1/jobs/{job_id}/logs").text


def submit_spec(api, probe: str, target: dict, **extra) -> str:
    spec = {"name": f"hostile-{probe}", "resources": {"nproc_per_node": 1, "device": "cpu"},
            "entrypoint": {"script": "hostile.py", "args": [probe]}, "env": {"TARGET": json.dumps(target)},
            "timeout_s": 120, **extra}
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_init_from_a_model_that_is_a_link_is_refused_naming_it_and_lends_nothing(stack):
    database = stack.settings.data_dir / "trainjobs.db"
    source, logs = plant(stack, "model-link", str(database))
    assert source["status"] == "succeeded", logs
    job, logs = plant(stack, "nothing", init_from={"job": source["id"], "checkpoint": "final"})
    assert job["status"] == "failed", logs
    assert job["error"]["type"] == "init_from_unavailable"
    assert "artifacts/model.pt is a link" in job["error"]["message"]
    assert "SQLite format" not in logs and job["attempt"] == 1  # never launched, never retried
    # The next job of the same worker runs.
    job, logs = plant(stack, "nothing")
    assert job["status"] == "succeeded", logs


def test_a_checkpoint_that_is_a_link_to_another_jobs_is_no_checkpoint(stack, victim):
    source, logs = plant(stack, "checkpoint-link", str(victim["checkpoints"]))
    assert source["status"] == "succeeded", logs
    with stack.client(timeout=10) as api:
        spec = {"resources": {"nproc_per_node": 1, "device": "cpu"}, "entrypoint": {"script": "hostile.py"},
                "init_from": {"job": source["id"], "checkpoint": "latest"}}
        response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and "init_from" in response.text, response.text


def test_a_metrics_file_made_a_fifo_fails_its_job_at_once_and_the_lane_runs_the_next(stack):
    job, logs = plant(stack, "metrics-fifo")
    assert job["status"] == "failed", logs
    assert job["error"]["type"] == "unsafe_file" and "metrics.jsonl is a FIFO" in job["error"]["message"], job
    assert job["attempt"] == 1  # not retried: it would plant it again
    job, logs = plant(stack, "nothing")
    assert job["status"] == "succeeded", logs


def test_a_metrics_file_linked_to_another_file_is_not_read(stack, tmp_path):
    other = tmp_path / "other-jobs-metrics.jsonl"
    other.write_text(json.dumps({"type": "metrics", "step": 1, "time": 1.7e9, "metrics": {"stolen": 1.0}}) + "\n")
    os.chmod(tmp_path, 0o755)
    job, logs = plant(stack, "metrics-link", str(other))
    assert job["status"] == "failed", logs
    assert job["error"]["type"] == "unsafe_file" and "metrics.jsonl is a link" in job["error"]["message"], job
    with stack.client(timeout=10) as api:
        assert api.get(f"/v1/jobs/{job['id']}/metrics").json()["series"] == []


def test_a_ranks_error_file_linked_to_a_root_only_file_is_not_read_into_the_jobs_error(stack, tmp_path):
    secret = tmp_path / "root-only.json"  # what torchrun's error file holds, so a read would show it whole
    secret.write_text(json.dumps({"message": {"message": "RootOnly: the host's secret"}}))
    secret.chmod(0o600)
    job, logs = plant(stack, "error-link", str(secret))
    assert job["status"] == "failed", logs
    assert "the host's secret" not in json.dumps(job) and "the host's secret" not in logs
    assert job["error"]["type"] == "process_exit" and "exited with code" in job["error"]["message"], job["error"]
