"""Builds run where the job's code runs (issue 41, worker/build_sandbox.py): the filtering proxy, the pip options
passed into the sandbox, and a build on a worker that is not root. The builds through real workers are in
tests/test_requirements.py, which shares its stack; make_index here makes their hostile packages."""

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from service.settings import Settings
from worker import build_sandbox, environments, launch, sandbox

pytestmark = pytest.mark.skipif(sandbox.detect(Settings()).bwrap is None, reason="no sandbox on this machine")

# An in-tree PEP 517 backend: whatever it finds while pip builds it (as whom it runs, what it reads and reaches) it
# writes into the package it builds, so the job that imports it prints it.
BACKEND = '''\
import base64, hashlib, json, os, socket, time, zipfile

PROBE = json.loads(%(probe)r)


def _probe():
    found = {"uid": os.getuid(), "gid": os.getgid()}
    for path in PROBE.get("read", []):
        try:
            with open(path, "rb") as f:
                f.read(1)
            found["read " + path] = "read"
        except OSError as exc:
            found["read " + path] = type(exc).__name__
    for path in PROBE.get("list", []):
        try:
            found["list " + path] = sorted(os.listdir(path))
        except OSError as exc:
            found["list " + path] = type(exc).__name__
    for port in PROBE.get("ports", []):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
            found["connect %%d" %% port] = "connected"
        except OSError as exc:
            found["connect %%d" %% port] = type(exc).__name__
    proxy = os.environ.get("HTTPS_PROXY", "")
    for target in PROBE.get("through_proxy", []) if proxy else ():
        try:
            host, port = proxy.rsplit("/", 1)[-1].rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(("CONNECT %%s HTTP/1.1\\r\\nHost: %%s\\r\\n\\r\\n" %% (target, target)).encode())
            found["proxy " + target] = s.recv(200).decode(errors="replace").split("\\r\\n")[0]
            s.close()
        except OSError as exc:
            found["proxy " + target] = type(exc).__name__
    return found


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(PROBE.get("sleep", 0))
    name, version = PROBE["name"], "0.1"
    files = {name + ".py": "FINDINGS = %%r\\n" %% (_probe(),),
             "%%s-%%s.dist-info/METADATA" %% (name, version): "Metadata-Version: 2.1\\nName: %%s\\nVersion: %%s\\n" %% (
                 name, version),
             "%%s-%%s.dist-info/WHEEL" %% (name, version): "Wheel-Version: 1.0\\nGenerator: probe\\n"
             "Root-Is-Purelib: true\\nTag: py3-none-any\\n"}
    record = "%%s-%%s.dist-info/RECORD" %% (name, version)
    lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        lines.append("%%s,sha256=%%s,%%d" %% (path, digest, len(text.encode())))
    files[record] = "\\n".join(lines + [record + ",,"]) + "\\n"
    wheel = "%%s-%%s-py3-none-any.whl" %% (name, version)
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel
'''


def make_index(root: Path, packages: dict[str, dict]) -> str:
    """A PEP 503 index of sdists, one per name, each built by BACKEND with its probe; its file:// URL."""
    (root / "files").mkdir(parents=True)
    for name, probe in packages.items():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            members = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "probe_backend"\n'
                                         f'backend-path = ["."]\n\n[project]\nname = "{name}"\nversion = "0.1"\n',
                       "probe_backend.py": BACKEND % {"probe": json.dumps({"name": name, **probe})},
                       "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"}
            for path, text in members.items():
                info = tarfile.TarInfo(f"{name}-0.1/{path}")
                info.size, info.mode = len(text.encode()), 0o644
                tar.addfile(info, io.BytesIO(text.encode()))
        (root / "files" / f"{name}-0.1.tar.gz").write_bytes(buffer.getvalue())
        (root / "simple" / name).mkdir(parents=True)
        (root / "simple" / name / "index.html").write_text(
            f'<html><body><a href="../../files/{name}-0.1.tar.gz">{name}-0.1.tar.gz</a></body></html>\n')
    for path in (root, *root.rglob("*")):  # the build's uid reads it (pytest's folders are 0700)
        path.chmod(0o755 if path.is_dir() else 0o644)
    return f"file://{root}/simple"


def ask(proxy: build_sandbox.Proxy, request: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(proxy.path))
        s.sendall(request.encode())
        return s.recv(4096).decode(errors="replace").split("\r\n")[0]


def test_the_build_proxy_reaches_the_index_alone_and_never_the_hosts_own_services(tmp_path):
    hosts = {"pypi.org": {443}, "localhost": {6379}, "mirror.internal": {443}}
    with build_sandbox.Proxy(tmp_path / "p.sock", hosts, configured={"pypi.org", "mirror.internal"}) as proxy:
        assert ask(proxy, "CONNECT pypi.org:443 HTTP/1.1\r\n\r\n").startswith("HTTP/1.1 200")
        for request in ("CONNECT pypi.org:22 HTTP/1.1\r\n\r\n", "CONNECT example.com:443 HTTP/1.1\r\n\r\n",
                        "CONNECT 127.0.0.1:6379 HTTP/1.1\r\n\r\n", "CONNECT localhost:6379 HTTP/1.1\r\n\r\n",
                        "GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\nHost: x\r\n\r\n",
                        "GET ftp://pypi.org/ HTTP/1.1\r\n\r\n"):
            assert ask(proxy, request).startswith("HTTP/1.1 403"), request
        assert any("localhost" in r and "loopback" in r for r in proxy.refused), list(proxy.refused)
    # The addresses: loopback, link-local (the cloud's metadata) and reserved never; private only for a host the
    # operator configured (an internal mirror); a documentation range is this CI's registry's address.
    never = ["127.0.0.1", "::1", "169.254.169.254", "fe80::1", "0.0.0.0", "224.0.0.1", "240.0.0.1",
             "::ffff:127.0.0.1"]
    assert all(build_sandbox.refused_address(a, configured=True) for a in never)
    assert build_sandbox.refused_address("10.1.2.3", configured=False)
    assert build_sandbox.refused_address("fd00::1", configured=False)
    assert not build_sandbox.refused_address("10.1.2.3", configured=True)
    assert not build_sandbox.refused_address("203.0.113.80", configured=False)


def test_the_build_reaches_the_hosts_of_pips_configuration_and_direct_urls_only_where_allowed():
    config = {"index-url": "https://pypi.org/simple", "extra-index-url": "file:///opt/x/simple http://m.lan:8080/s",
              "find-links": "https://dl.example/wheels /opt/wheels"}
    direct = ["tomli-w==1.0.0", "evil @ https://evil.example/evil-0.1.tar.gz"]
    hosts = build_sandbox.allowed_hosts(config, Settings(pip_index_hosts="extra.example,other:8443"), direct)
    assert hosts == {"pypi.org": {443}, "files.pythonhosted.org": {443}, "m.lan": {8080}, "dl.example": {443},
                     "extra.example": {443}, "other": {8443}}
    allowed = build_sandbox.allowed_hosts(config, Settings(allow_direct_urls=True), direct)
    assert allowed["evil.example"] == {443}
    assert build_sandbox.index_urls({"no-index": "true", "index-url": "https://x"}) == []


def test_a_worker_that_is_not_root_builds_in_a_user_namespace_seeing_only_its_env(tmp_path):
    """The build on a worker of an ordinary uid: pip and the backend as the worker's uid, in namespaces without
    root; the data dir's service files unseen; the env built and usable."""
    if os.geteuid() != 0:
        pytest.skip("the test drops from root to nobody")
    root = Path(tempfile.mkdtemp(prefix="tj-nonroot-build-", dir="/tmp"))
    try:
        root.chmod(0o755)
        (root / "data").mkdir()
        (root / "data" / "trainjobs.db").write_text("sqlite")
        index = make_index(root / "index", {"probepkg": {"read": [str(root / "data" / "trainjobs.db")],
                                                         "ports": [], "through_proxy": ["127.0.0.1:6379"]}})
        subprocess.run(["chown", "-R", "65534:65534", str(root / "data")], check=True)
        code = (
            "import sys; from pathlib import Path; from service.settings import Settings\n"
            "from worker import environments, launch, sandbox\n"
            f"s = Settings(data_dir='{root}/data')\n"
            "assert sandbox.for_worker(s).on and not sandbox.for_worker(s).own_uid\n"
            f"cache = environments.EnvCache(Path('{root}/data/envs'), max_bytes=2**30)\n"
            "env = cache.acquire(['probepkg'], output=lambda b: sys.stderr.write(b.decode()), tick=lambda: False,\n"
            "                    timeout_s=120, base_env=launch.default_env(), settings=s, job_id='j' * 20)\n"
            "import subprocess; subprocess.run([env.python, '-c', 'import probepkg; print(probepkg.FINDINGS)'])\n")
        env = {**os.environ, "HOME": str(root), "PIP_INDEX_URL": "file:///nonexistent/simple",
               "PIP_EXTRA_INDEX_URL": index}
        # NOTE: a worker's uid can run its own Python. This CI's lies under /root (0700): the worker is given a
        # view of the host where /root holds that Python alone, as a home folder of its own would.
        python = Path(sys.base_prefix)
        view = ["bwrap", "--dev-bind", "/", "/", *sandbox.with_parents(["--perms", "0755", "--tmpfs", "/root",
                                                                        "--ro-bind", str(python), str(python)])]
        done = subprocess.run([*view, "--", "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                               sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                              cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr
        findings = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - the dict the backend wrote
        assert findings["uid"] == 65534, findings
        assert findings[f"read {root}/data/trainjobs.db"] == "FileNotFoundError", findings
        assert findings["proxy 127.0.0.1:6379"].startswith("HTTP/1.1 403"), findings
        assert "in the sandbox:" in done.stderr and "as uid" not in done.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_build_past_its_timeout_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    """TRAINJOBS_PIP_TIMEOUT_S still holds with pip in the sandbox: the sleeping backend, pip and bwrap end."""
    index = make_index(tmp_path / "index", {"sleeppkg": {"sleep": 120, "ports": [], "read": []}})
    monkeypatch.setenv("PIP_INDEX_URL", "file:///nonexistent/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index)
    settings = Settings(data_dir=tmp_path / "data")
    envs = tmp_path / "data" / "envs"
    cache = environments.EnvCache(envs, max_bytes=2**30)
    lines: list[bytes] = []
    started = time.monotonic()
    with pytest.raises(environments.RequirementsFailed, match="ran past 4s"):
        cache.acquire(["sleeppkg"], output=lines.append, tick=lambda: False, timeout_s=4,
                      base_env=launch.default_env(), settings=settings, job_id="k" * 20)
    assert time.monotonic() - started < 20
    assert b"in the sandbox" in b"".join(lines)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(envs) in " ".join(p.info["cmdline"] or [])]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left
    assert not any(envs.glob("*/")), list(envs.iterdir())  # the half-built env is gone
