"""spec.image (issue 44): a job runs in its own image's root, pulled from a real registry on loopback, cached.

The registry is Debian's docker-registry (the CNCF distribution registry); the images are tests/image_build.py's,
built with umoci once per machine. skopeo and umoci are the worker's; .ci/run installs all three. Private
registries: tests/test_image_registry.py; the image's Env, WorkingDir and own packages: tests/test_image_config.py;
a gang in an image: tests/test_image_gang.py.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from service.settings import Settings
from tests.helpers import live_stack, wait_for, wait_terminal
from tests.image_build import blob_reads, entry, needs_sandbox, needs_tools, serving_registry
from trainjobs.spec import IMAGES_LABEL, JobSpec
from worker import image_box, images, sandbox

WHERE = """import os, sys, torch
print("marker", open("/image-marker").read().strip())
print("os", [l for l in open("/etc/os-release").read().splitlines() if l.startswith("ID=")][0])
print("python", sys.executable, os.path.realpath(sys.executable))
print("torch", torch.__version__, torch.__file__)
print("host python seen", os.path.exists(sys.base_prefix + "/../../../root/.pyenv"), os.path.exists("/root/.pyenv"))
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "uid", os.getuid())
"""


def test_a_malformed_reference_is_refused_naming_image(client):
    answer = client.post("/v1/jobs", json=entry("Team/Train::x"))
    assert answer.status_code == 422
    assert "image" in answer.text and "not an image reference" in answer.text


def test_an_image_job_asks_for_a_worker_that_runs_images():
    spec = JobSpec.model_validate(entry("registry.example.com/team/train:2025-11"))
    assert spec.resources.selector == {IMAGES_LABEL: "on"}
    with pytest.raises(ValueError, match="requirements"):
        JobSpec.model_validate(entry("r.example.com/a:1") | {"entrypoint": {"script": "x.py", "requirements": ["a"]}})


def test_a_worker_without_skopeo_says_so_in_its_labels_and_refuses(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "skopeo" else "/usr/bin/" + name)
    assert images.labels(True) == {IMAGES_LABEL: "off"}
    with pytest.raises(images.ImageUnavailable, match="cannot run images: skopeo is not installed"):
        images.ImageCache(Settings(data_dir=tmp_path)).get("127.0.0.1:1/a:1")


def test_the_image_root_binds_no_link_and_makes_room_for_the_jobs_folders(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("")
    (root / "etc" / "hosts").write_text("")
    (root / "proc").mkdir()
    (root / "bin").symlink_to("/etc")  # a link of the image is made again, never followed on the host
    (root / "usr").mkdir()
    args = image_box.image_root(root, ["/etc/hosts", "/data/x"])
    assert ["--symlink", "/etc", "/bin"] == args[:3]
    assert ["--perms", "0755", "--dir", "/etc"] == args[3:7]  # expanded: /etc/hosts is the sandbox's own
    assert str(root / "etc" / "passwd") in args and str(root / "etc" / "hosts") not in args
    assert "/proc" not in args and ["--ro-bind", str(root / "usr"), "/usr"] == args[-3:]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """The open registry, with the test images: (host:port, its log file)."""
    from tests import image_build

    python_layout, bare_layout = image_build.build()
    with serving_registry(tmp_path_factory.mktemp("registry"),
                          {"test/py:1": f"{python_layout}:image", "test/bare:1": f"{bare_layout}:image"}) as served:
        yield served


@needs_tools
@needs_sandbox
def test_a_job_runs_in_its_images_root_and_a_second_pulls_nothing(registry, postgres_url, tmp_path_factory):
    where, log = registry
    scripts = tmp_path_factory.mktemp("scripts")
    (scripts / "where.py").write_text(WHERE)
    data = tmp_path_factory.mktemp("images-data")
    with live_stack(postgres_url, data, name="images", allow_entrypoints=True, scripts_dir=scripts,
                    image_insecure_registries=where) as stack, stack.client(timeout=10) as api:
        wait_for(lambda: api.get("/v1/workers").json()["items"], 30, what="the worker")
        assert all(w["labels"].get(IMAGES_LABEL) == "on" for w in api.get("/v1/workers").json()["items"])
        before = blob_reads(log)
        started = time.monotonic()
        first = wait_terminal(api, api.post("/v1/jobs", json=entry(f"{where}/test/py:1", nproc=2)).json()["id"])
        cold_s = time.monotonic() - started
        logs = api.get(f"/v1/jobs/{first['id']}/logs").text
        assert first["status"] == "succeeded", (first["error"], logs[-3000:])
        assert "marker only in the image" in logs and "os ID=trainjobs-test-image" in logs
        assert "torch 2.99.0+image /opt/py/lib/python3.11/site-packages/torch/__init__.py" in logs  # not the host's
        assert "python /usr/local/bin/python3 /opt/py/bin/python3.11" in logs
        assert "host python seen False False" in logs and "rank 1 of 2" in logs
        assert "uid 0" not in logs  # dropped by the host's setpriv, which the image does not have
        pulled = blob_reads(log)
        assert pulled > before

        started = time.monotonic()
        second = wait_terminal(api, api.post("/v1/jobs", json=entry(f"{where}/test/py:1")).json()["id"])
        warm_s = time.monotonic() - started
        assert second["status"] == "succeeded", second["error"]
        assert blob_reads(log) == pulled  # the tag's manifest read again, no layer
        assert len([p for p in (data / "image-cache").iterdir() if p.is_dir()]) == 1
        print(f"image job: cold {cold_s:.1f}s (pull + unpack + check), warm {warm_s:.1f}s")

        bare = wait_terminal(api, api.post("/v1/jobs", json=entry(f"{where}/test/bare:1")).json()["id"])
        assert bare["status"] == "failed" and bare["error"]["type"] == "image_unusable"
        assert "has no python3" in bare["error"]["message"] and bare["attempt"] == 1

        missing = wait_terminal(api, api.post("/v1/jobs", json=entry(f"{where}/test/nothing:1")).json()["id"])
        assert missing["status"] == "failed" and missing["error"]["type"] == "image_unavailable"
        assert "test/nothing:1" in missing["error"]["message"]


def test_the_cache_evicts_the_least_recently_used_image_but_never_one_in_use(tmp_path):
    import fcntl

    cache = images.ImageCache(Settings(data_dir=tmp_path, image_cache_bytes=150))
    cache.root.mkdir()
    old = time.time() - 3600
    for age, name in enumerate(("inuse", "oldest", "newer")):
        (cache.root / name / "rootfs").mkdir(parents=True)
        (cache.root / f"{name}.bytes").write_text("100")
        (cache.root / f"{name}.used").touch()
        os.utime(cache.root / f"{name}.used", (old + age, old + age))
    held = os.open(cache.root / "inuse.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_SH)  # an attempt runs on it
    try:
        assert cache.evict() == ["oldest", "newer"]  # 300 bytes over 150: "inuse" is older but held
        assert (cache.root / "inuse" / "rootfs").is_dir() and not (cache.root / "oldest").exists()
    finally:
        os.close(held)
    smaller = images.ImageCache(Settings(data_dir=tmp_path, image_cache_bytes=50))
    assert smaller.evict() == ["inuse"]  # released: now it may go


@needs_tools
def test_two_lanes_naming_one_image_pull_it_once(registry, tmp_path):
    import threading

    where, log = registry
    reference = f"{where}/test/bare:1"
    before = blob_reads(log)
    alone = images.ImageCache(Settings(data_dir=tmp_path / "a", image_insecure_registries=where)).get(reference)
    alone.release()
    one_pull = blob_reads(log) - before
    assert one_pull > 0 and alone.pulled_s is not None

    cache = images.ImageCache(Settings(data_dir=tmp_path / "b", image_insecure_registries=where))
    got: list[images.Image] = []
    lanes = [threading.Thread(target=lambda: got.append(cache.get(reference))) for _ in range(3)]
    before = blob_reads(log)
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join(60)
    assert len(got) == 3 and len({i.rootfs for i in got}) == 1
    assert blob_reads(log) - before == one_pull  # one lane pulled; the others waited and found it
    assert sum(i.pulled_s is not None for i in got) == 1
    for image in got:
        image.release()


DRIVER_CHECK = """import os, subprocess
lib = "/usr/local/nvidia/lib64"
print("driver libs", sorted(os.listdir(lib)), open(lib + "/libcuda.so.1").read().strip())
try:
    open(lib + "/libcuda.so.1", "a")
    print("driver writable")
except OSError as exc:
    print("driver read-only", type(exc).__name__)
print("smi", subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.strip())
print("env", os.environ.get("LD_LIBRARY_PATH"), os.environ["PATH"].split(":")[0])
"""


def fake_driver(folder: Path) -> Path:
    """A driver's user-space files as ldconfig would find them (libcuda, libnvidia-ml, nvidia-smi), and one of
    the host's other libraries, which is not the driver's."""
    folder.mkdir()
    (folder / "libcuda.so.550.54.15").write_text("fake libcuda\n")
    (folder / "libcuda.so.1").symlink_to("libcuda.so.550.54.15")
    (folder / "libnvidia-ml.so.1").write_text("fake nvml\n")
    (folder / "libnvidia-encode.so.1").write_text("not lent\n")
    (folder / "nvidia-smi").write_text("#!/usr/local/bin/python3\nprint('GPU 3: fake (UUID: GPU-0)')\n")
    (folder / "nvidia-smi").chmod(0o755)
    return folder


@needs_tools
@needs_sandbox
def test_a_gpu_jobs_image_gets_the_hosts_driver_read_only_and_a_cpu_jobs_does_not(registry, tmp_path, monkeypatch):
    where, _ = registry
    monkeypatch.setenv(image_box.DRIVER_DIR_ENV, str(fake_driver(tmp_path / "driver")))
    settings = Settings(data_dir=tmp_path / "data", image_insecure_registries=where)
    image = images.ImageCache(settings).get(f"{where}/test/py:1")
    support = sandbox.detect(settings)
    job_dir = tmp_path / "storage" / "jobs" / "j1"
    for folder in (job_dir / "checkpoints", job_dir / "artifacts", tmp_path / "run", tmp_path / "scripts"):
        folder.mkdir(parents=True)
    try:
        def run(devices: tuple[str, ...]) -> str:
            attempt = sandbox.Attempt(job_id="j1", run_dir=tmp_path / "run", job_dir=job_dir, python="python3",
                                      data_dir=settings.data_dir, scripts_dir=tmp_path / "scripts",
                                      devices=devices, image=image)
            env = image_box.job_env({"LANG": "C.UTF-8"}, image, devices)
            argv = sandbox.command(support, settings, attempt, ["python3", "-c", DRIVER_CHECK], env)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=sandbox.LAUNCH_ENV)
            return done.stdout + done.stderr

        gpu = run(("/dev/nvidia3", "/dev/nvidiactl"))  # the job's GPU: the nodes themselves are not on this host
        assert "driver libs ['libcuda.so.1', 'libcuda.so.550.54.15', 'libnvidia-ml.so.1'] fake libcuda" in gpu, gpu
        assert "driver read-only" in gpu and "smi GPU 3: fake" in gpu
        assert "env /usr/local/nvidia/lib64 /usr/local/nvidia/bin" in gpu
        cpu = run(())
        assert "No such file or directory: '/usr/local/nvidia/lib64'" in cpu and "fake" not in cpu
    finally:
        image.release()
