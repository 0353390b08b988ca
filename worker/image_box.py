"""spec.image's part of the sandbox (issue 44): the image's rootfs as the job's /, what the worker lends into it
(trainjobs' packages, the host's setpriv), its environment, and the one check that its python3 and torch run.

worker/sandbox.py builds bwrap's command line (namespaces, the job's folders, its uid) and calls these where an
attempt has an image; this module knows images, not namespaces. Every path the worker renders into a command line
(the runtime, gang_init.py, the job's folders) is bound at its own path, so it stays true inside the image.
"""

import functools
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import trainjobs
import worker
from trainjobs import runenv
from worker import images

# The host's GPU driver, as the NVIDIA container toolkit lends it: its user-space libraries and nvidia-smi, read-only,
# where NVIDIA's images look (their LD_LIBRARY_PATH and PATH name /usr/local/nvidia); only with a GPU node of the
# job's. TRAINJOBS_GPU_DRIVER_DIR names a folder to take them from instead of ldconfig's cache (tests; a driver
# installed where ldconfig does not look).
DRIVER_DIR_ENV = "TRAINJOBS_GPU_DRIVER_DIR"
DRIVER_LIBS = re.compile(r"^lib(cuda|nvidia-ml)\.so(\.[0-9.]+)?$")
NVIDIA_LIB, NVIDIA_BIN = "/usr/local/nvidia/lib64", "/usr/local/nvidia/bin"
GPU_NODE = re.compile(r"^/dev/nvidia[0-9]+$")
HOST_TOOLS = "/.trainjobs-host"  # the host's setpriv and the libraries it runs on, where the image has neither
IMAGE_OWN_MOUNTS = ("proc", "dev", "tmp", "sys")  # the sandbox's own, never the image's
LDD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
CHECK_TIMEOUT_S = 120
IMAGE_CHECK = """import sys
if sys.version_info < (3, 10):
    print("python", sys.version.split()[0]); sys.exit(3)
try:
    import torch
except Exception as exc:
    print("notorch", type(exc).__name__, exc); sys.exit(4)
print("torch", torch.__version__)
"""


def runtime_paths() -> list[str]:
    """trainjobs' light package and the worker's (the built-in runtime, user_main.py, gang_init.py), at their
    own paths: every path the worker renders into a command line stays true in the image."""
    return sorted(str(Path(m.__file__).parent) for m in (trainjobs, worker))


def runtime_mounts() -> list[str]:
    return [arg for path in runtime_paths() for arg in ("--ro-bind", path, path)]


def _host_setpriv_mounts(setpriv: str) -> tuple[list[str], list[str]]:
    """(mounts, argv): the host's setpriv run by the host's loader on the host's libraries, bound under
    HOST_TOOLS. NOTE: not the image's setpriv: an image may lack one, or carry one that does not drop."""
    found = subprocess.run(["ldd", setpriv], capture_output=True, text=True, env=LDD_ENV).stdout
    mounts, loader = ["--ro-bind", setpriv, f"{HOST_TOOLS}/setpriv"], None
    for line in found.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        path = (rest if arrow else name).split(" (")[0].strip()
        if not path.startswith("/"):
            continue
        if arrow:
            mounts += ["--ro-bind", os.path.realpath(path), f"{HOST_TOOLS}/lib/{name}"]
        else:
            loader = os.path.realpath(path)
    if loader is None:  # a static setpriv
        return mounts, [f"{HOST_TOOLS}/setpriv"]
    mounts += ["--ro-bind", loader, f"{HOST_TOOLS}/ld.so"]
    return mounts, [f"{HOST_TOOLS}/ld.so", "--library-path", f"{HOST_TOOLS}/lib", f"{HOST_TOOLS}/setpriv"]


@functools.cache
def host_setpriv(setpriv: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(its mounts, the argv that runs it) of the host's `setpriv` inside an image; found once per process."""
    mounts, argv = _host_setpriv_mounts(setpriv)
    return tuple(mounts), tuple(argv)


def image_root(rootfs: Path, points: list[str], dest: str = "/") -> list[str]:
    """The image's entries read-only at their places under `dest`; a folder a later mount point lies in is made
    in bwrap's root instead and its entries bound one by one (so the point can be made: the image is read-only).

    Never follows a link of the image (rule 6: an image is the job's): a link is made again as a link."""
    args: list[str] = []
    for entry in sorted(os.scandir(rootfs), key=lambda e: e.name):
        target = f"{dest.rstrip('/')}/{entry.name}"
        if (dest == "/" and entry.name in IMAGE_OWN_MOUNTS) or target in points:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), target]
        elif entry.is_dir(follow_symlinks=False) and any(p.startswith(f"{target}/") for p in points):
            args += ["--perms", "0755", "--dir", target, *image_root(Path(entry.path), points, target)]
        else:
            args += ["--ro-bind", entry.path, target]
    return args


# What the image's config knows better than the worker: the locale its root has files for. The worker's other
# variables (its network interfaces, NCCL's tuning, thread counts, the operator's TRAINJOBS_JOB_ENV) describe the
# machine, and win over the image's.
IMAGE_WINS = ("LANG", "LANGUAGE", "TZ", "LC_*")
MAX_LINKS = 40  # as the kernel's path walk: a WorkingDir behind more links than this is not followed


def _image_wins(name: str) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in IMAGE_WINS)


def image_env(image: images.Image) -> dict[str, str]:
    """The image config's Env a job gets: all of it but the names a job's spec.env may not set either
    (runenv.reserved_env: the worker's own TRAINJOBS_*, HOME, TMPDIR, the visible devices, LD_PRELOAD and what else
    loads code). PATH, PYTHONPATH and LD_LIBRARY_PATH are the image's too, merged by job_env."""
    return {k: v for k, v in image.env.items() if not runenv.reserved_env(k)}


def with_image_env(worker_env: dict[str, str], image: images.Image | None) -> dict[str, str]:
    """The worker's variables a job gets (sandbox.job_env), with its image's Env laid in: over the locale, under
    the rest. spec.env is laid over this, and the worker's run names over that (worker/launch.py render)."""
    if image is None:
        return worker_env
    env = {k: v for k, v in worker_env.items() if _image_wins(k)}
    env.update(image_env(image))
    env.update({k: v for k, v in worker_env.items() if not _image_wins(k)})
    return env


def job_env(env: dict[str, str], image: images.Image, devices: tuple[str, ...] = ()) -> dict[str, str]:
    """The job's variables in its image: the image's PATH (it finds the image's python3); on PYTHONPATH the job's
    (its scripts), trainjobs' packages, then the image's own; the image's LD_LIBRARY_PATH, not the host's. With a
    GPU, the lent driver's folders first on PATH and last on LD_LIBRARY_PATH."""
    env = {k: v for k, v in env.items() if k != "LD_LIBRARY_PATH"}
    runtime = [str(Path(p).parent) for p in runtime_paths()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in (env.get("PYTHONPATH"), *runtime,
                                                                  image.env.get("PYTHONPATH")) if p))
    env["PATH"] = image.path
    own = [p for p in image.env.get("LD_LIBRARY_PATH", "").split(":") if p]
    if driver_mounts(devices):  # after the image's own folders, as NVIDIA's images name it: their compat libcuda first
        own = own if NVIDIA_LIB in own else [*own, NVIDIA_LIB]
        env["PATH"] = f"{NVIDIA_BIN}:{image.path}"
    if own:
        env["LD_LIBRARY_PATH"] = ":".join(own)
    return env


def start_dir(image: images.Image) -> str | None:
    """The image's WorkingDir, where it names a folder of the image; None without one. Walked on the host inside
    the rootfs, each link resolved against the image's root (never the host's): only whether it is there is
    asked here; bwrap's --chdir then goes to it inside the sandbox."""
    if not image.workdir.startswith("/"):
        return None
    parts, here, hops = [p for p in image.workdir.split("/") if p not in ("", ".")], image.rootfs, 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            here = here.parent if here != image.rootfs else here
            continue
        step = here / part
        try:
            info = os.lstat(step)
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            hops += 1
            target = os.readlink(step)
            if hops > MAX_LINKS:
                return None
            here = image.rootfs if target.startswith("/") else here
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
        elif stat.S_ISDIR(info.st_mode):
            here = step
        else:
            return None
    return image.workdir


def driver_files() -> dict[str, str]:
    """The host's driver files a GPU job's image gets: {its path in the image: the host's file}."""
    folder = os.environ.get(DRIVER_DIR_ENV)
    if folder:
        libs = {p.name: p for p in sorted(Path(folder).iterdir()) if DRIVER_LIBS.match(p.name)}
        smi = Path(folder) / "nvidia-smi"
        smi = smi if smi.is_file() else None
    else:
        libs = _ldconfig_libs()
        found = shutil.which("nvidia-smi", path=LDD_ENV["PATH"])
        smi = Path(found) if found else None
    files = {f"{NVIDIA_LIB}/{name}": str(path.resolve()) for name, path in libs.items()}
    if smi is not None:
        files[f"{NVIDIA_BIN}/nvidia-smi"] = str(smi.resolve())
    return files


def _ldconfig_libs() -> dict[str, Path]:
    """libcuda and libnvidia-ml as the host's loader cache lists them (64-bit), by the names a program asks for."""
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, env=LDD_ENV, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in listed.splitlines():
        name, _, rest = line.strip().partition(" (")
        flags, _, path = rest.partition(") => ")
        if DRIVER_LIBS.match(name) and "64" in flags and name not in found and os.path.isfile(path):
            found[name] = Path(path)
    return found


def driver_mounts(devices: tuple[str, ...]) -> list[str]:
    """The driver's files bound read-only into a job's image where the job was given a GPU node; none else (a
    CPU job's image never sees the host's driver). The device nodes are the sandbox's own: the job's only."""
    if not any(GPU_NODE.match(d) for d in devices):
        return []
    return [arg for dest, host in driver_files().items() for arg in ("--ro-bind", host, dest)]


def check(image: images.Image, probe: Callable[[list[str]], subprocess.CompletedProcess], *, builtin: bool) -> str:
    """The image's torch version, from running IMAGE_CHECK on its python3 (`probe(argv)`: in the job's sandbox,
    as its uid), or ImageUnusable saying what is missing. Remembered per image (a second job on it starts
    without the check). A job of the user's own code (not `builtin`) starts in the image's WorkingDir."""
    checked = image.entry / "checked"
    if checked.is_file():
        version = checked.read_text().strip()
    else:
        try:
            done = probe(["python3", "-c", IMAGE_CHECK])
        except subprocess.TimeoutExpired:
            raise images.ImageUnusable(f"image {image.reference}: python3 -c 'import torch' took over "
                                       f"{CHECK_TIMEOUT_S}s") from None
        version = _verdict(image, done)
        checked.write_text(version)
    if builtin and _older(version, (2, 4)):
        raise images.ImageUnusable(f"image {image.reference}: torch {version} in the image; the built-in runtime "
                                   "needs 2.4 or later")
    # NOTE: the built-in runtime starts in its run dir all the same: `python -m worker.train` puts its folder first
    # on sys.path, where an image's own `worker` or `trainjobs` in its WorkingDir would hide the worker's.
    image.cwd = None if builtin else start_dir(image)
    return version


def _verdict(image: images.Image, done: subprocess.CompletedProcess) -> str:
    """The torch version IMAGE_CHECK printed, or ImageUnusable in the words of what failed."""
    words = done.stdout.strip().splitlines()[-1:] or [""]
    kind, _, rest = words[0].partition(" ")
    if done.returncode != 0 and kind not in ("python", "notorch"):
        why = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        if "execvp python3" in why[0] or "No such file" in why[0]:
            raise images.ImageUnusable(f"image {image.reference} has no python3 on its PATH ({image.path})")
        raise images.ImageUnusable(f"image {image.reference}: python3 does not start: {why[0][:300]}")
    if kind == "python":
        raise images.ImageUnusable(f"image {image.reference}: python {rest} in the image; trainjobs needs "
                                   "3.10 or later")
    if kind == "notorch":
        raise images.ImageUnusable(f"image {image.reference}: torch missing in the image ({rest[:200]})")
    return rest


def _older(version: str, than: tuple[int, int]) -> bool:
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < than
