"""`trainjobs up --registry` (issue 44, one machine stays one command): the stack serves an image registry on
loopback, its workers pull from it without TLS, and a job runs in an image pushed there; the worker then names the
image among those it has (placement's preference). An address off loopback, or no docker-registry, is refused
naming why."""

import subprocess
import sys

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from service.cli import local_registry
from service.workers.models import Worker
from tests.helpers import free_port, live_stack, wait_for, wait_terminal
from tests.image_build import entry, needs_sandbox, needs_tools


def test_a_registry_off_loopback_or_malformed_is_refused_naming_why(tmp_path):
    with pytest.raises(local_registry.RegistryUnavailable, match="loopback only"):
        local_registry.check("10.0.0.7:5000")
    with pytest.raises(local_registry.RegistryUnavailable, match="host:port"):
        local_registry.check("127.0.0.1")
    up = subprocess.run([sys.executable, "-m", "service.cli", "up", "--registry", "0.0.0.0:5000", "--port",
                         str(free_port())], env={"TRAINJOBS_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"},
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 2 and "loopback only" in up.stdout, (up.stdout, up.stderr)
    assert local_registry.insecure_with("a:1", "127.0.0.1:5000") == "a:1,127.0.0.1:5000"
    assert local_registry.insecure_with("127.0.0.1:5000", "127.0.0.1:5000") == "127.0.0.1:5000"


@needs_tools
@needs_sandbox
def test_up_serves_a_registry_its_workers_pull_a_job_s_image_from(postgres_url, tmp_path):
    from tests import image_build

    python_layout, _ = image_build.build()
    address = f"127.0.0.1:{free_port()}"
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "where.py").write_text('print("in the image:", open("/image-marker").read().strip())\n')
    with live_stack(postgres_url, tmp_path / "data", name="localreg", registry=address, allow_entrypoints=True,
                    scripts_dir=scripts) as stack, stack.client(timeout=10) as api:
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{python_layout}:image",
                        f"docker://{address}/team/py:1"], check=True, timeout=300)
        job = wait_terminal(api, api.post("/v1/jobs", json=entry(f"{address}/team/py:1")).json()["id"])
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
        assert job["status"] == "succeeded", (job["error"], logs[-2000:])
        assert "in the image: only in the image" in logs
        engine = create_engine(postgres_url)

        def named() -> bool:  # its next heartbeat names the image: the pass prefers this worker for it
            with Session(engine) as db:
                return any(f"{address}/team/py:1" in (had or []) for had in db.scalars(select(Worker.images)))
        try:
            wait_for(named, 30, what="the worker to name the image it has")
        finally:
            engine.dispose()
    assert (tmp_path / "data" / "registry" / "store" / "docker").is_dir()  # the blobs lie in the stack's data dir
