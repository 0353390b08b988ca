"""A sandboxed job's ranks get their grace: on a cancel and on a hand-back (its worker shutting down) each rank's
SIGTERM handler runs and saves, before anything is killed (worker/processes.py spares bwrap, whose end would take
the whole PID namespace down at once)."""

import signal
from pathlib import Path

import pytest

from service.cli.stack import Stack
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL
from tests.helpers import free_port, wait_for, wait_terminal
from trainjobs import paths
from worker import sandbox

SCRIPTS = Path(__file__).with_name("grace")
pytestmark = pytest.mark.skipif(sandbox.detect(Settings()).bwrap is None, reason="no sandbox on this machine")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("grace")
    settings = Settings(data_dir=root / "data", redis_url=REDIS_URL, queue_prefix=f"{QUEUE_PREFIX}grace",
                        allow_entrypoints=True, scripts_dir=SCRIPTS, poll_s=0.2, cancel_grace_s=10)
    with Stack(settings, port=free_port(), workers=1, quiet=True) as s:
        yield s


def start(stack, api) -> tuple[str, Path]:
    """A 2-rank job of save_on_sigterm.py, once both ranks are ready; its artifacts folder on this machine."""
    spec = {"name": "save-on-sigterm", "resources": {"nproc_per_node": 2, "device": "cpu"},
            "entrypoint": {"script": "save_on_sigterm.py"}, "timeout_s": 300}
    response = api.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}/logs").text.count(": ready") == 2, 120, what="both ranks ready")
    return job_id, paths.job_dir(stack.settings.resolved_storage_dir, job_id) / paths.ARTIFACTS


def test_a_cancelled_sandboxed_job_runs_every_ranks_sigterm_handler(stack):
    with stack.client(timeout=10) as api:
        job_id, artifacts = start(stack, api)
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        job = wait_terminal(api, job_id, timeout=60)
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
    assert job["status"] == "cancelled"
    assert sorted(p.name for p in artifacts.iterdir()) == ["saved-rank0-attempt1", "saved-rank1-attempt1"], logs
    assert "saved on SIGTERM" in logs


def test_a_job_handed_back_by_its_sandboxed_worker_saves_before_it_goes(stack):
    worker = next(p for name, p in stack.procs if name.startswith("worker") and p.poll() is None)
    with stack.client(timeout=10) as api:
        job_id, artifacts = start(stack, api)
        worker.send_signal(signal.SIGTERM)  # the worker shuts down: the job is handed back
        assert worker.wait(timeout=60) == 0
        job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["attempt"] == 1, job
    assert sorted(p.name for p in artifacts.iterdir()) == ["saved-rank0-attempt1", "saved-rank1-attempt1"]
