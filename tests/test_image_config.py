"""An image's config beyond PATH, and its own packages (issue 44).

Its Env is the job's: all of it, under the job's spec.env, under the worker's own names (TRAINJOBS_*, HOME, what
loads code); over the worker's locale, under the worker's machine variables (NCCL_*, thread counts). Its
WorkingDir is where a job of the user's own code starts when the job has no package; the built-in runtime starts
in its run dir. A package only the image has is importable there, and not on the worker's Python.
"""

import os
from pathlib import Path

import pytest

from service.settings import Settings
from tests.helpers import live_stack, wait_for, wait_terminal
from tests.image_build import APP_PACKAGE, entry, needs_sandbox, needs_tools, serving_registry
from trainjobs.spec import JobSpec
from worker import image_box, images
from worker.attempt import prepare
from worker.attempt.place import Placed

USES_PACKAGE = f"""import {APP_PACKAGE[0]} as pkg
print("{APP_PACKAGE[0]}", pkg.__version__, "from", pkg.__file__)
"""


def an_image(rootfs: Path, env: dict[str, str], workdir: str = "") -> images.Image:
    return images.Image("r.example.com/a:1", "sha256:" + "0" * 64, rootfs, env, workdir)


def test_the_images_env_lies_under_the_jobs_env_and_the_workers_own_names(tmp_path):
    image = an_image(tmp_path, {
        "GREETING": "image", "SHARED": "image", "LANG": "C.UTF-8", "NCCL_SOCKET_IFNAME": "image0",
        "TRAINJOBS_JOB_ID": "forged", "LD_PRELOAD": "/evil.so", "HOME": "/image-home", "CUDA_VISIBLE_DEVICES": "0,1",
        "PATH": "/opt/conda/bin:/usr/bin", "PYTHONPATH": "/opt/app-lib", "LD_LIBRARY_PATH": "/opt/conda/lib"})
    spec = JobSpec.model_validate(entry(image.reference) | {"env": {"SHARED": "the job's"}})
    worker = {"LANG": "en_US.UTF-8", "NCCL_SOCKET_IFNAME": "eth7", "PATH": "/usr/bin", "LD_LIBRARY_PATH": "/host"}
    run_dir = tmp_path / "run"
    code = prepare.Code(tmp_path, entry_script=tmp_path / "where.py", image=image)
    plan = prepare.render(spec, Settings(data_dir=tmp_path / "data"), job_id="j1", attempt=1, run_dir=run_dir,
                          job_dir=tmp_path / "job", python="python3", code=code, placed=Placed(None, "cpu"),
                          gang=None, environ=worker)
    env = image_box.job_env({**plan.env, "HOME": str(run_dir / "home")}, image)
    assert env["GREETING"] == "image" and env["SHARED"] == "the job's"  # the job's spec.env wins over the image
    assert env["LANG"] == "C.UTF-8"  # the image knows its own locales
    assert env["NCCL_SOCKET_IFNAME"] == "eth7"  # the worker knows its own network
    assert env["TRAINJOBS_JOB_ID"] == "j1" and env["HOME"] == str(run_dir / "home")
    assert "LD_PRELOAD" not in env and "CUDA_VISIBLE_DEVICES" not in env  # reserved, as in a spec's env
    assert env["PATH"] == "/opt/conda/bin:/usr/bin" and env["LD_LIBRARY_PATH"] == "/opt/conda/lib"  # not /host
    runtime = str(Path(image_box.runtime_paths()[0]).parent)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), runtime, "/opt/app-lib"]  # scripts, ours, its


def test_the_working_dir_is_found_inside_the_image_never_on_the_host(tmp_path):
    root = tmp_path / "rootfs"
    (root / "opt" / "app").mkdir(parents=True)
    (root / "workspace").symlink_to("/opt/app")  # absolute: the image's /opt/app, not the host's
    (root / "up").symlink_to("../../../../etc")  # climbs no higher than the image's /
    (root / "file").write_text("")
    os.symlink("/etc", root / "hosts-etc")  # the host has /etc; the image has not
    assert image_box.start_dir(an_image(root, {}, "/workspace")) == "/workspace"
    assert image_box.start_dir(an_image(root, {}, "/workspace/../app")) == "/workspace/../app"
    assert image_box.start_dir(an_image(root, {}, "/hosts-etc")) is None
    assert image_box.start_dir(an_image(root, {}, "/up")) is None
    assert image_box.start_dir(an_image(root, {}, "/file")) is None
    assert image_box.start_dir(an_image(root, {}, "relative")) is None
    assert image_box.start_dir(an_image(root, {}, "")) is None
    (root / "loop").symlink_to("loop")
    assert image_box.start_dir(an_image(root, {}, "/loop")) is None


@pytest.fixture(scope="module")
def app_registry(tmp_path_factory):
    """A registry serving the app image (a layer with its own package, Env and WorkingDir): (host:port, log)."""
    from tests import image_build

    python_layout, _ = image_build.build()
    with serving_registry(tmp_path_factory.mktemp("app-registry"), {"test/app:1": f"{python_layout}:app"}) as served:
        yield served


@needs_tools
@needs_sandbox
def test_a_job_gets_its_images_env_working_dir_and_packages(app_registry, postgres_url, tmp_path_factory):
    where, _ = app_registry
    image = f"{where}/test/app:1"
    scripts = tmp_path_factory.mktemp("scripts")
    (scripts / "uses_package.py").write_text(USES_PACKAGE)
    with live_stack(postgres_url, tmp_path_factory.mktemp("app-data"), name="image-config", allow_entrypoints=True,
                    scripts_dir=scripts, image_insecure_registries=where) as stack, stack.client(timeout=10) as api:
        wait_for(lambda: api.get("/v1/workers").json()["items"], 30, what="the worker")

        spec = entry(image) | {"entrypoint": {"module": "app_main"}, "env": {"TJ_IMAGE_OVERRIDDEN": "the job's"}}
        job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"])
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
        assert job["status"] == "succeeded", (job["error"], logs[-3000:])
        assert "cwd /workspace" in logs  # the image's WorkingDir: its module is found there
        assert "env TJ_IMAGE_GREETING = hello from the image config" in logs
        assert "env TJ_IMAGE_OVERRIDDEN = the job's" in logs
        assert f"env TRAINJOBS_JOB_ID = {job['id']}" in logs and "forged" not in logs
        assert "env LD_PRELOAD = None" in logs and "not-a-library" not in logs
        assert "env HOME = /image-home" not in logs
        name, version = APP_PACKAGE
        assert f"package {version} {version} /opt/py/lib/python3.11/site-packages/{name}/__init__.py" in logs
        assert "app lib the image's own PYTHONPATH" in logs

        in_image = wait_terminal(api, api.post("/v1/jobs", json=entry(image, "uses_package.py")).json()["id"])
        logs = api.get(f"/v1/jobs/{in_image['id']}/logs").text
        assert in_image["status"] == "succeeded", (in_image["error"], logs[-3000:])
        assert f"{name} {version} from /opt/py/lib/python3.11/site-packages/{name}/__init__.py" in logs

        on_worker = wait_terminal(api, api.post("/v1/jobs", json=entry(None, "uses_package.py")).json()["id"])
        logs = api.get(f"/v1/jobs/{on_worker['id']}/logs").text
        assert on_worker["status"] == "failed"
        assert f"ModuleNotFoundError: No module named '{name}'" in logs + str(on_worker["error"])
