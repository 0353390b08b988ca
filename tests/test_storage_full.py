"""A full storage disk fails the job that filled it with a reason that names the disk, removes its half-written
checkpoint, and puts the worker under disk pressure (no job taken, said in /v1/workers) until space is back; on
`trainjobs up`'s layout (SQLite, storage and runs on one disk) the failure is still recorded. Real jobs, real
workers, a real small tmpfs (root only)."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from service.cli.stack import Stack
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL, mlp_spec
from tests.helpers import free_port, live_stack, wait_for, wait_terminal
from tests.test_disk_pressure import fill

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a disk that fills) needs root")

MIN_FREE = 4 * 2**20
# ~4.3M parameters: a checkpoint (weights and AdamW's two moments) of ~52 MB, more than the disks below hold.
BIG = mlp_spec(name="big-checkpoint", model={"type": "mlp", "hidden": [2048, 2048]}, max_retries=0,
               train={"max_steps": 10, "log_every": 5, "seed": 0, "checkpoint_every": 5})


def mount_tmpfs(folder: Path, size: int) -> Path:
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    return folder


def unmount(folder: Path) -> None:
    if subprocess.run(["umount", str(folder)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    mount = mount_tmpfs(tmp_path_factory.mktemp("full") / "disk", 40 * 2**20)
    yield mount
    unmount(mount)


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory, disk):
    with live_stack(postgres_url, tmp_path_factory.mktemp("full-data"), name="full", storage_dir=disk / "storage",
                    worker_min_free_bytes=MIN_FREE, heartbeat_s=0.5) as s:
        yield s


def assert_disk_full(job: dict, storage: Path) -> None:
    error = job["error"]
    assert job["status"] == "failed" and error["type"] == "disk_full", error
    assert error["message"].startswith(f"no space left on the disk of {storage}"), error["message"]
    assert "partial checkpoint step_00000005 was removed" in error["message"], error["message"]
    assert not list((storage / "jobs" / job["id"] / "checkpoints").glob("step_*"))


def test_a_checkpoint_that_fills_the_storage_disk_fails_its_job_by_name_and_leaves_no_partial_one(api, stack, disk):
    job_id = api.post("/v1/jobs", json=BIG).json()["id"]
    assert_disk_full(wait_terminal(api, job_id, timeout=180), stack.settings.resolved_storage_dir)
    # The half-written checkpoint's space is back: the worker takes jobs again (said at its next heartbeat).
    wait_for(lambda: api.get("/v1/workers").json()["items"][0]["pressure"] is None, 30, what="pressure gone")


def test_a_worker_under_disk_pressure_takes_no_job_says_why_and_takes_them_again_once_space_is_back(api, stack, disk):
    filler = fill(disk)
    try:
        worker = wait_for(lambda: next((w for w in api.get("/v1/workers").json()["items"] if w["pressure"]), None),
                          30, what="disk pressure in /v1/workers")
        assert worker["pressure"].startswith(f"disk pressure: {stack.settings.resolved_storage_dir} has ")
        assert "TRAINJOBS_WORKER_MIN_FREE_BYTES=4194304" in worker["pressure"]
        job_id = api.post("/v1/jobs", json=mlp_spec(name="waits-for-space")).json()["id"]
        time.sleep(3)
        assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    finally:
        filler.unlink()
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    wait_for(lambda: api.get("/v1/workers").json()["items"][0]["pressure"] is None, 30, what="pressure gone")


def test_on_trainjobs_ups_layout_a_full_disk_still_records_the_jobs_failure(tmp_path, monkeypatch):
    """SQLite, storage and runs share one disk: the failed checkpoint's space, freed, lets the failure be written."""
    monkeypatch.setenv("TRAINJOBS_MIN_FREE_BYTES", str(MIN_FREE))  # /readyz's bound, for the stack to start
    disk = mount_tmpfs(tmp_path / "disk", 48 * 2**20)
    try:
        settings = Settings(data_dir=disk / "data", redis_url=REDIS_URL, queue_prefix=f"{QUEUE_PREFIX}sqlitefull",
                            worker_min_free_bytes=MIN_FREE, poll_s=0.2, cancel_grace_s=3)
        with Stack(settings, port=free_port(), workers=1, quiet=True) as stack, stack.client() as api:
            job_id = api.post("/v1/jobs", json=BIG).json()["id"]
            assert_disk_full(wait_terminal(api, job_id, timeout=180), settings.resolved_storage_dir)
    finally:
        unmount(disk)
