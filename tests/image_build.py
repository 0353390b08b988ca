"""The test images of tests/test_image*.py, built without Docker and without the network, and the registry that
serves them. Each is an OCI layout (umoci) whose first layer holds a small root of its own:

- `python`: a copy of the worker's interpreter (its standard library and the shared libraries it loads, ~60 MB) at
  /opt/py, not where the host has it; `torch` is a stub package of the image's own (torch.__version__
  "2.99.0+image", and a torchrun that starts the ranks as torchrun does), so a job proves it runs the image's torch
  where a second real torch would cost gigabytes. /etc/os-release and /image-marker exist only in the image.
- `bare`: the same root without Python.
- `app`: `python` and a second layer: a pure-Python package the worker's venv lacks (APP_PACKAGE), a module in
  /workspace and one in /opt/app-lib; its config sets Env (APP_ENV) and WorkingDir /workspace.
- `torch` (build_torch, ~1 GB unpacked; only the tests and the bench that train): the same Python with the
  worker's real torch and what the built-in runtime imports (pydantic, numpy, ...) copied into its site-packages.

Built once per machine and inputs (this file, the interpreter) under ~/.cache/trainjobs-test/images/<key>/.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

CACHE = Path(os.environ.get("TRAINJOBS_TEST_IMAGE_CACHE", Path.home() / ".cache" / "trainjobs-test" / "images"))
OS_RELEASE = 'PRETTY_NAME="trainjobs test image"\nID=trainjobs-test-image\n'
MARKER = "only in the image\n"
TORCH_VERSION = "2.99.0+image"
SKIP_STDLIB = {"test", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "unittest",
               "pydoc_data", "config-3.11-x86_64-linux-gnu"}
TORCHRUN = '''"""A small torchrun of the image's own: --nproc-per-node ranks of the target, torchrun's variables."""
import os, socket, subprocess, sys

def main(argv):
    nproc, i = 1, 0
    takes = {"--nnodes", "--nproc-per-node", "--max-restarts", "--log-dir", "--node-rank", "--rdzv-backend",
             "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--local-addr"}
    while i < len(argv) and argv[i].startswith("--"):
        if argv[i] == "--nproc-per-node":
            nproc = int(argv[i + 1])
        i += 2 if argv[i] in takes else 1
    target = argv[i:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *target], env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r),
             "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}) for r in range(nproc)]
    sys.exit(max(p.wait() for p in procs))

if __name__ == "__main__":
    main(sys.argv[1:])
'''

APP_PACKAGE = ("tj_image_demo", "3.1.4")  # pure Python, in the app image's site-packages; the worker's venv lacks it
APP_ENV = (
    "TJ_IMAGE_GREETING=hello from the image config",
    "TJ_IMAGE_OVERRIDDEN=the image's",  # a job's spec.env sets it too: the job's wins
    "TRAINJOBS_JOB_ID=forged-by-the-image",  # the worker's own names win over the image's
    "LD_PRELOAD=/opt/app-lib/not-a-library.so",  # reserved as in a spec's env: never reaches the sandbox
    "HOME=/image-home",  # the sandbox's own
    "PYTHONPATH=/opt/app-lib",  # kept, before trainjobs' packages
)
APP_MAIN = """import os, sys
from importlib.metadata import version
import app_lib_mod, tj_image_demo
print("cwd", os.getcwd())
for name in ("TJ_IMAGE_GREETING", "TJ_IMAGE_OVERRIDDEN", "TRAINJOBS_JOB_ID", "LD_PRELOAD", "HOME"):
    print("env", name, "=", os.environ.get(name))
print("package", tj_image_demo.__version__, version("tj_image_demo"), tj_image_demo.__file__)
print("app lib", app_lib_mod.WHERE)
"""


def key() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"{sys.base_prefix} {sys.version}".encode())
    return digest.hexdigest()[:16]


def _ldd(path: Path) -> set[Path]:
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        where = (rest if arrow else name).split(" (")[0].strip()
        if where.startswith("/"):
            found.add(Path(where))
    return found


def _python_root(root: Path) -> None:
    """The interpreter, its standard library and what it loads, at /opt/py; python3 on the image's PATH."""
    base = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(base), "base": str(base)})["stdlib"])
    py = root / "opt" / "py"
    (py / "bin").mkdir(parents=True)
    shutil.copy2(base / "bin" / version, py / "bin" / version)
    shutil.copytree(stdlib, py / "lib" / version, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in SKIP_STDLIB or n.startswith("_tkinter")])
    (root / "usr" / "local" / "bin").mkdir(parents=True)
    (root / "usr" / "local" / "bin" / "python3").symlink_to(f"/opt/py/bin/{version}")
    libs = _ldd(base / "bin" / version)
    for module in (py / "lib" / version / "lib-dynload").glob("*.so"):
        libs |= _ldd(module)
    (root / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (root / "lib64").mkdir()
    for lib in libs:
        if lib.name.startswith("ld-linux"):
            shutil.copy2(lib.resolve(), root / "lib64" / lib.name)
        elif not any(x in lib.name for x in ("libX", "libtk", "libtcl", "libxcb", "libfont", "libfreetype",
                                              "libpng")):
            shutil.copy2(lib.resolve(), root / "lib" / "x86_64-linux-gnu" / lib.name)
    torch = py / "lib" / version / "site-packages" / "torch"
    (torch / "distributed").mkdir(parents=True)
    (torch / "__init__.py").write_text(f'__version__ = "{TORCH_VERSION}"\n')
    (torch / "distributed" / "__init__.py").write_text("")
    (torch / "distributed" / "run.py").write_text(TORCHRUN)


def _layout(root: Path, layout: Path, tag: str) -> None:
    """An OCI layout at `layout` holding `root` as one layer, tagged `tag`."""
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:{tag}"], check=True)
    bundle = layout.with_name(f"bundle-{tag}")
    subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle)], check=True)
    shutil.rmtree(bundle / "rootfs")
    shutil.copytree(root, bundle / "rootfs", symlinks=True)
    subprocess.run(["umoci", "repack", "--image", f"{layout}:{tag}", str(bundle)], check=True)
    subprocess.run(["umoci", "config", "--image", f"{layout}:{tag}", "--config.env",
                    "PATH=/usr/local/bin:/usr/bin:/bin"], check=True)
    shutil.rmtree(bundle)


def _app_layer(layout: Path) -> None:
    """`layout`:app, the image tag plus a layer of an application's own, and its config's Env and WorkingDir."""
    bundle = layout.with_name("bundle-app")
    subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{layout}:image", str(bundle)], check=True)
    rootfs = bundle / "rootfs"
    site = rootfs / "opt" / "py" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    name, version = APP_PACKAGE
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(f'"""A package only the app image has."""\n__version__ = "{version}"\n')
    (site / f"{name}-{version}.dist-info").mkdir()
    (site / f"{name}-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                                                   f"Version: {version}\n")
    (rootfs / "workspace").mkdir()
    (rootfs / "workspace" / "app_main.py").write_text(APP_MAIN)
    (rootfs / "opt" / "app-lib").mkdir()
    (rootfs / "opt" / "app-lib" / "app_lib_mod.py").write_text('WHERE = "the image\'s own PYTHONPATH"\n')
    subprocess.run(["umoci", "repack", "--image", f"{layout}:app", str(bundle)], check=True)
    shutil.rmtree(bundle)
    env = [arg for item in APP_ENV for arg in ("--config.env", item)]
    subprocess.run(["umoci", "config", "--image", f"{layout}:app", *env, "--config.workingdir", "/workspace"],
                   check=True)


def build() -> tuple[Path, Path]:
    """(the Python image's layout: tags image and app, a layout without Python), built once per key."""
    home = CACHE / key()
    done = home / "done"
    if done.is_file():
        return home / "python", home / "bare"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    for name, with_python in (("python", True), ("bare", False)):
        root = home / f"root-{name}"
        _base_root(root)
        if with_python:
            _python_root(root)
        _layout(root, home / name, "image")
        shutil.rmtree(root)
    _app_layer(home / "python")
    done.write_text("")
    return home / "python", home / "bare"


def _base_root(root: Path) -> None:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text(OS_RELEASE)
    (root / "image-marker").write_text(MARKER)
    for top in ("proc", "dev", "tmp", "sys"):
        (root / top).mkdir()


def torch_packages() -> list[Path]:
    """The worker's site-packages entries that torch and the built-in runtime import (and their native libraries)."""
    code = ("import sys, worker.train.main, torch.distributed.checkpoint, torch.distributed.fsdp\n"
            "site = [p for p in sys.path if p.endswith('site-packages')][0]\n"
            "print('\\n'.join(sorted({m.__file__[len(site) + 1:].split('/')[0] for m in list(sys.modules.values())"
            " if (getattr(m, '__file__', None) or '').startswith(site + '/')})))\nprint(site)")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1]).stdout.split()
    site, names = Path(lines[-1]), [n for n in lines[:-1] if not n.startswith("__editable__")]
    found = [site / n for n in names] + [site / f"{n}.libs" for n in names if (site / f"{n}.libs").is_dir()]
    return sorted(set(found))


def build_torch() -> Path:
    """The `torch` image's layout (tag image): the Python image's root with the worker's real torch, built once."""
    home = CACHE / key() / "torch-build"
    done = home / "done"
    if done.is_file():
        return home / "torch"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    root = home / "root"
    _base_root(root)
    _python_root(root)
    site = root / "opt" / "py" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    shutil.rmtree(site / "torch")  # the stub: the real one instead
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.copytree(stdlib / "unittest", site.parent / "unittest")  # torch imports unittest.mock
    for package in torch_packages():
        if package.is_dir():
            shutil.copytree(package, site / package.name, symlinks=True,
                            ignore=shutil.ignore_patterns("include", "test", "tests"))
        else:
            shutil.copy2(package, site / package.name)
    libs = root / "lib" / "x86_64-linux-gnu"
    for lib in {lib for so in site.rglob("*.so*") if so.is_file() for lib in _ldd(so)}:
        if "site-packages" not in lib.parts and not (libs / lib.name).exists():  # libstdc++, libgcc_s, ...
            shutil.copy2(lib.resolve(), libs / lib.name)
    _layout(root, home / "torch", "image")
    shutil.rmtree(root)
    done.write_text("")
    return home / "torch"


TOOLS = ("skopeo", "umoci", "docker-registry")
MISSING = [t for t in TOOLS if shutil.which(t) is None]
needs_tools = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(TOOLS)} (apt-get install skopeo umoci "
                                 "docker-registry; .ci/run installs them)")
needs_sandbox = pytest.mark.skipif(os.geteuid() != 0 and shutil.which("bwrap") is None, reason="needs bubblewrap")


def entry(image: str | None, script: str = "where.py", nproc: int = 1) -> dict:
    """An entrypoint job's spec running `script` of the scripts dir, in `image` (None: on the worker's Python)."""
    return {"entrypoint": {"script": script}, "resources": {"nproc_per_node": nproc}, "strategy": "ddp",
            **({"image": image} if image else {})}

# --- the registry: Debian's docker-registry (the CNCF distribution registry) on a loopback port ---
@contextmanager
def serving_registry(home: Path, images: dict[str, str], *, login: tuple[str, str] | None = None):
    """docker-registry on a loopback port, with `images` (name:tag → an OCI layout's path:tag) pushed; with
    `login`, it asks for that one (htpasswd, bcrypt): (host:port, its log file)."""
    from tests.helpers import free_port, wait_for

    port = free_port()
    auth = ""
    if login is not None:
        (home / "htpasswd").write_text(htpasswd_line(*login) + "\n")
        auth = f"auth:\n  htpasswd:\n    realm: trainjobs-test\n    path: {home / 'htpasswd'}\n"
    (home / "config.yml").write_text(f"version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n"
                                     f"    rootdirectory: {home / 'store'}\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}")
    log = home / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["docker-registry", "serve", str(home / "config.yml")], stdout=out, stderr=out)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401)
            except httpx.HTTPError:
                return False
        wait_for(up, 20, what="the registry")
        creds = ["--dest-creds", ":".join(login)] if login else []
        for name, source in images.items():
            subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds, f"oci:{source}",
                            f"docker://127.0.0.1:{port}/{name}"], check=True, timeout=600)
        yield f"127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(10)


def htpasswd_line(user: str, password: str) -> str:
    """`user:bcrypt-hash`, the only scheme the registry's htpasswd takes: libcrypt's, through Python's crypt
    module (3.11: deprecated, still there), else the htpasswd tool."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))  # cost 4: a quick test
        if hashed and hashed.startswith("$2"):
            return f"{user}:{hashed}"
    except (ImportError, AttributeError, ValueError):
        pass
    if shutil.which("htpasswd") is None:
        raise RuntimeError("no bcrypt here: neither Python's crypt module nor htpasswd (apache2-utils)")
    return subprocess.run(["htpasswd", "-nbB", "-C", "4", user, password], capture_output=True, text=True,
                          check=True).stdout.strip()


def blob_reads(log: Path) -> int:
    """How many layer or config blobs the registry has served (its access log)."""
    return len(re.findall(r"GET /v2/[^ ]+/blobs/sha256:", log.read_text(errors="replace")))


if __name__ == "__main__":
    print(build(), build_torch() if "--torch" in sys.argv else "")
