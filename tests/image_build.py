"""The test image of tests/test_images.py, built without Docker and without the network: an OCI layout (umoci)
whose one layer holds a small root of its own. Python is a copy of the worker's interpreter (its standard library
and the shared libraries it loads, ~60 MB) at /opt/py, not where the host has it; `torch` is a stub package of the
image's own (torch.__version__ "2.99.0+image", and a torchrun that starts the ranks as torchrun does), so a job
proves it runs the image's torch where a second real torch would cost gigabytes. /etc/os-release and /image-marker
exist only in the image.

Built once per machine and inputs (this file, the interpreter) under ~/.cache/trainjobs-test/images/<key>/.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

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


def build() -> tuple[Path, Path]:
    """(the Python image's layout, a layout without Python), built once per key."""
    home = CACHE / key()
    done = home / "done"
    if done.is_file():
        return home / "python", home / "bare"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    for name, with_python in (("python", True), ("bare", False)):
        root = home / f"root-{name}"
        (root / "etc").mkdir(parents=True)
        (root / "etc" / "os-release").write_text(OS_RELEASE)
        (root / "image-marker").write_text(MARKER)
        for top in ("proc", "dev", "tmp", "sys"):
            (root / top).mkdir()
        if with_python:
            _python_root(root)
        _layout(root, home / name, "image")
        shutil.rmtree(root)
    done.write_text("")
    return home / "python", home / "bare"


if __name__ == "__main__":
    print(build())
