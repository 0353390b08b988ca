"""The sandbox around every attempt: bubblewrap namespaces, a uid of the job's own, and what the job may see.

Why bubblewrap: it is the well-kept, small tool that Flatpak builds on; it makes user, mount, PID, IPC, UTS and
network namespaces without a daemon, and as an unprivileged user (so a worker needs no root). Around torchrun:

- **mounts**: a fresh root with the system read-only (/usr, /etc, /sys, the Python the job runs on, its venv,
  trainjobs' own packages), the data dir read-only with the service's own folders in it hidden (runs, storage,
  caches, the SQLite file), and read-write only the attempt's run dir and the job's checkpoints and artifacts; a
  private /tmp and /dev/shm (one per node: its ranks share it, as NCCL needs); a /dev of the basics and the GPU
  nodes the job was given. Not the secrets dir, other jobs' folders, the package cache, the worker's home.
- **PID namespace**: the job sees its own processes only; when its first process (bwrap's init) dies, the kernel
  kills everything left in the namespace, a double-forked daemon and a fork bomb included. --die-with-parent
  ends it when the supervisor dies, even SIGKILLed.
- **network**: a single-node job gets a namespace of its own with loopback alone (TRAINJOBS_JOB_NETWORK=1 lets it
  out); a gang shares the host's network, since its nodes must reach each other: a right an admin grants per
  user (users.multinode, service/jobs/admission.py), and the worker's labels say so (sandbox-gang-net: host).
- **/sys** read-only but /sys/fs/cgroup (an empty tmpfs: the tree names every attempt); cgroups named opaquely.
- **uid**: a worker running as root runs bwrap (it can then bind what root can read) and drops the job to a uid
  of its own inside (setpriv: base + a hash of the job id, the same on every attempt and node, so its
  checkpoints stay its own); a worker that is not root runs the job in a user namespace as its own uid, which
  cannot reach another job's folders because they are not mounted.
- the **environment** is an allow-list (job_env), not the worker's less a deny-list; bwrap and setpriv themselves
  start on LAUNCH_ENV, and the job's variables are handed through --setenv.
"""

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

import trainjobs
import worker
from service import jobfiles
from service.settings import Settings
from service.workers.fit import RESERVED_LABEL_PREFIX
from trainjobs import paths
from trainjobs.runenv import RUN_TAG_ENV
from worker import cgroups, image_box, images

log = logging.getLogger(__name__)
SANDBOX_LABEL = f"{RESERVED_LABEL_PREFIX}sandbox"  # "on" | "off": what a spec's selector may require
REDIS_AUTH_LABEL = f"{RESERVED_LABEL_PREFIX}redis-auth"  # "password" | "none": whether its Redis asks for one
# What a multi-node gang's ranks share: "host" (its hosts' network; only users granted multinode run one, issue 41).
# A worker that one day gives each gang a network of its own says "private", and a selector may ask for that.
GANG_NET_LABEL = f"{SANDBOX_LABEL}-gang-net"
# bwrap's own environment (root, before it drops): the job's variables are handed through --setenv.
LAUNCH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# The worker's own variables a job gets (besides the run's, the spec's env and TRAINJOBS_JOB_ENV's).
# The operator's configuration of the machine's devices, network interfaces and threads is the job's too.
BASIC_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "LC_*", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_*",
             "NCCL_*", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Folders and files of the service that live in the data dir, hidden from a job that is shown the data dir.
SERVICE_OWNED = paths.SERVICE_OWNED
GPU_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
SETPRIV = "/usr/bin/setpriv"
GANG_INIT = Path(__file__).with_name("gang_init.py")
MAX_ENTRIES = 512  # a folder shown entry by entry (_contents) up to this many


class SandboxUnavailable(RuntimeError):
    """This worker must run jobs in a sandbox and cannot make one."""


@dataclass(frozen=True)
class Support:
    """What this worker enforces, found once at its start (and shown in /v1/workers as labels)."""

    bwrap: str | None  # bwrap's path when a sandbox works here, else None
    own_uid: bool  # the worker is root: each job runs as a uid of its own
    cgroup: str | None  # "v1" | "v2": per-attempt memory and process limits; None: none
    network: str  # "private" (single-node jobs: loopback only) | "host"
    why_not: str = ""  # why there is no sandbox

    @property
    def on(self) -> bool:
        return self.bwrap is not None

    def labels(self) -> dict[str, str]:
        if not self.on:
            return {SANDBOX_LABEL: "off", GANG_NET_LABEL: "host", **images.labels(False)}
        return {SANDBOX_LABEL: "on", f"{SANDBOX_LABEL}-uid": "own" if self.own_uid else "worker's",
                f"{SANDBOX_LABEL}-cgroup": self.cgroup or "none", f"{SANDBOX_LABEL}-net": self.network,
                GANG_NET_LABEL: "host", **images.labels(True)}

    def describe(self) -> str:
        if not self.on:
            return f"no sandbox ({self.why_not})"
        net = ", net" if self.network == "private" else ""
        user = "" if self.own_uid else "user, "
        return (f"sandbox: bubblewrap namespaces ({user}mount, pid, ipc, uts{net}), "
                f"{'a uid per job' if self.own_uid else 'the worker uid in a user namespace'}, "
                f"cgroup limits {self.cgroup or 'none'}")


def detect(settings: Settings) -> Support:
    """Can this machine make the sandbox? Tries bwrap once, as a job would use it."""
    root = os.geteuid() == 0
    network = "host" if settings.job_network else "private"
    if settings.sandbox == "off":
        return Support(None, False, None, "host", why_not="TRAINJOBS_SANDBOX=off")
    exe = shutil.which("bwrap")
    why = ""
    if exe is None:
        why = "bubblewrap (bwrap) is not installed"
    elif root and not os.access(SETPRIV, os.X_OK):
        why = f"{SETPRIV} (util-linux) is missing: a root worker needs it to give each job a uid of its own"
    else:
        probe = [exe, *_namespace_args(root=root, network=False), "--ro-bind", "/", "/", "--proc", "/proc",
                 "--dev", "/dev", "--", "/bin/true"]
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                why = f"bwrap cannot make namespaces here: {done.stderr.strip()[:300]}"
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"bwrap failed: {exc}"
    if why:
        return Support(None, False, None, "host", why_not=why)
    return Support(exe, root, cgroups.detect(), network)


def check_start(settings: Settings, support: Support) -> None:
    """Fail closed: a worker that runs users' code in no sandbox starts only when the operator said so."""
    if support.on:
        return
    if settings.sandbox == "required":
        raise SandboxUnavailable(f"TRAINJOBS_SANDBOX=required, but {support.why_not}")
    if settings.allow_entrypoints and settings.sandbox != "off":
        raise SandboxUnavailable(f"this worker runs users' own code (TRAINJOBS_ALLOW_ENTRYPOINTS) but cannot sandbox "
                                 f"it: {support.why_not}. Install bubblewrap, or set TRAINJOBS_SANDBOX=off to run "
                                 "jobs unsandboxed (its labels then say so)")


def job_uid(settings: Settings, job_id: str) -> int:
    """The job's own uid on a root worker: the same on every node and attempt, so its files stay its own."""
    return settings.sandbox_uid_base + zlib.crc32(job_id.encode()) % settings.sandbox_uid_count


def job_env(settings: Settings, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's variables a job gets: the basics and what the operator names (TRAINJOBS_JOB_ENV)."""
    environ = dict(os.environ if environ is None else environ)
    patterns = [*BASIC_ENV, *(p.strip() for p in settings.job_env.split(",") if p.strip())]

    def passes(name: str) -> bool:
        return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)

    return {k: v for k, v in environ.items() if passes(k)}


@dataclass(frozen=True)
class Attempt:
    """One attempt's folders and devices, as the sandbox mounts them."""

    job_id: str
    run_dir: Path  # read-write: the spec, metrics, tmp, the package's copy
    job_dir: Path  # read-only but for its checkpoints and artifacts
    python: str  # the interpreter torchrun runs on (the worker's, or the job's venv)
    data_dir: Path
    scripts_dir: Path
    cwd: Path | None = None  # where the ranks start (the package's copy, or the run dir)
    init_from: Path | None = None  # where the ranks find init_from's weights (INIT_FROM_ENV)
    init_job: str | None = None  # whose they are: spec.init_from.job, as admission checked it
    init_fd: int | None = None  # the weights opened by lend_init_source: what is mounted at init_from
    devices: tuple[str, ...] = ()  # device nodes besides the basics (the job's GPUs)
    gang: bool = False
    node_rank: int = 0
    image: images.Image | None = None  # spec.image, pulled: its rootfs is the job's / (issue 44)


def _namespace_args(*, root: bool, network: bool) -> list[str]:
    args = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session"]
    if not root:
        args.append("--unshare-user")  # root binds as root, then drops to the job's uid (setpriv)
    if not network:
        args.append("--unshare-net")
    return args


def command(support: Support, settings: Settings, attempt: Attempt, argv: list[str],
            env: dict[str, str] | None = None) -> list[str]:
    """bwrap's command line around `argv` (torchrun), for this attempt; `env`, the job's variables, handed through
    (--clearenv, --setenv), so that bwrap and setpriv, root, start on LAUNCH_ENV and not on what a spec set."""
    network = attempt.gang or support.network == "host"
    if attempt.image is not None:
        return _finish(support, settings, attempt, argv, env, _image_mounts(settings, attempt, network=network),
                       network=network)
    # The private /tmp first: the data dir (or a job's venv in it) may lie under /tmp, and a later mount would
    # hide it; the Python last: a job's venv lies in the data dir's envs/, which the data dir's mounts leave out.
    mounts = _system_mounts() + ([] if network else _offline_names(attempt.run_dir))
    mounts += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs",
               "/dev/shm"]
    mounts += _data_mounts(settings, attempt)
    for path in _python_paths(attempt.python):
        mounts += ["--ro-bind", path, path]
    for device in attempt.devices:
        if os.path.exists(device):
            mounts += ["--dev-bind", device, device]
    return _finish(support, settings, attempt, argv, env, mounts, network=network)


def _finish(support: Support, settings: Settings, attempt: Attempt, argv: list[str], env: dict[str, str] | None,
            mounts: list[str], *, network: bool) -> list[str]:
    args = [support.bwrap, *_namespace_args(root=support.own_uid, network=network), *with_parents(mounts)]
    args += ["--chdir", str(attempt.cwd or attempt.run_dir)]
    if env is not None:
        args.append("--clearenv")
        for name, value in env.items():
            args += ["--setenv", name, value]
    if support.own_uid:
        uid = job_uid(settings, attempt.job_id)
        # init_from's weights are another job's files (0640, that job's group): the group is lent, read-only. Whose
        # group is the spec's init_from.job (admission checked the owner may read it), never where a path leads.
        groups = f"--groups={job_uid(settings, attempt.init_job)}" if attempt.init_job else "--clear-groups"
        setpriv = [SETPRIV] if attempt.image is None else list(image_box.host_setpriv(SETPRIV)[1])
        args += ["--", *setpriv, f"--reuid={uid}", f"--regid={uid}", groups, "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]
    if attempt.gang:
        argv = [attempt.python, "-I", str(GANG_INIT), str(attempt.node_rank), *argv]
    return [*args, "--", *argv]


def lend_init_source(support: Support, settings: Settings, job_id: str, source: Path) -> int:
    """A descriptor of init_from's weights (job_id's model.pt, or its checkpoint folder), opened as
    service/jobfiles.py opens a job's files: a link, a FIFO or a file not of that job is Refused, naming it. The
    sandbox mounts this descriptor (--ro-bind-fd), so what the job gets is what was checked."""
    folder = paths.job_dir(settings.resolved_storage_dir, job_id)
    rel = source.relative_to(folder)
    want_folder = rel.parts[0] == paths.CHECKPOINTS
    owners = jobfiles.owners_of(job_uid(settings, job_id) if support.own_uid else None)
    top = jobfiles.open_folder(folder)
    try:
        fd = jobfiles.open_beneath(top, rel, folder=want_folder, owners=owners)
    finally:
        os.close(top)
    if not want_folder and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise jobfiles.Refused(rel.as_posix(), "is not a regular file")
    return fd


ARITY = {"--ro-bind": 2, "--ro-bind-fd": 2, "--bind": 2, "--dev-bind": 2, "--symlink": 2, "--tmpfs": 1, "--proc": 1,
         "--dev": 1, "--dir": 1, "--perms": 1}


def with_parents(mounts: list[str]) -> list[str]:
    """`mounts` with the folders above each mount point made first, 0755.

    NOTE: bwrap makes a missing parent itself, but 0700 and root's when the worker is root: the job's uid could
    then not reach its own folders. A parent is made only where bwrap's root or a tmpfs holds it; one inside a
    bound folder is the real folder's.
    """
    out: list[str] = []
    points: dict[str, bool] = {"/": True}  # mount point -> made by bwrap (a tmpfs or its root): writable here
    i, perms = 0, []  # a --perms applies to the next operation: it goes after the parents made for that one
    while i < len(mounts):
        op, n = mounts[i], ARITY[mounts[i]]
        operands = mounts[i + 1:i + 1 + n]
        i += 1 + n
        if op == "--perms":
            perms = [op, *operands]
            continue
        dest = operands[-1]
        for parent in reversed(Path(dest).parents):
            key = str(parent)
            if key in points:
                continue
            holder = max((p for p in points if key.startswith(p.rstrip("/") + "/")), key=len)
            if points[holder]:
                out += ["--perms", "0755", "--dir", key]
                points[key] = True
        points[dest] = op in ("--tmpfs", "--dir", "--dev", "--proc")
        out += [*perms, op, *operands]
        perms = []
    return out


def _system_mounts() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", *_sys_mounts()]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _sys_mounts() -> list[str]:
    args = []
    if os.path.isdir("/sys"):
        args += ["--ro-bind", "/sys", "/sys"]  # CPU and GPU topology, /sys/class, /sys/bus/pci (NCCL, torch)
        if os.path.isdir("/sys/fs/cgroup"):  # every attempt's cgroup, its memory and CPU: none of the job's business
            args += ["--tmpfs", "/sys/fs/cgroup"]
    return args


def _destinations(mounts: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(mounts):
        n = ARITY[mounts[i]]
        if mounts[i] != "--perms":
            out.append(mounts[i + n])
        i += 1 + n
    return out


# --- spec.image (issue 44): the image's rootfs is /, the worker lends what a rank needs (worker/image_box.py) ---
def _image_mounts(settings: Settings, attempt: Attempt, *, network: bool) -> list[str]:
    """The image as /, then what every sandbox has but its system: /proc, /dev, /tmp, /sys, the job's folders,
    trainjobs' packages, the host's setpriv (a root worker), the job's devices and, with a GPU, the driver."""
    mounts = [] if network else _offline_names(attempt.run_dir)
    mounts += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs",
               "/dev/shm", *_sys_mounts()]
    mounts += _data_mounts(settings, attempt)
    mounts += image_box.runtime_mounts()
    if os.geteuid() == 0:
        mounts += list(image_box.host_setpriv(SETPRIV)[0])
    for device in attempt.devices:
        if os.path.exists(device):
            mounts += ["--dev-bind", device, device]
    mounts += image_box.driver_mounts(attempt.devices)  # the host's GPU driver, read-only: a GPU job's only
    return image_box.image_root(attempt.image.rootfs, _destinations(mounts)) + mounts


def check_image(support: Support, settings: Settings, image: images.Image, *, job_id: str, builtin: bool) -> str:
    """The image's torch version, checked once per image by running its python3 in the job's sandbox as the job's
    uid (image_box.check); ImageUnusable saying what is missing."""
    def probe(argv: list[str]) -> subprocess.CompletedProcess:
        mounts = ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        if support.own_uid:
            mounts += list(image_box.host_setpriv(SETPRIV)[0])
        args = [support.bwrap, *_namespace_args(root=support.own_uid, network=False),
                *with_parents(image_box.image_root(image.rootfs, _destinations(mounts)) + mounts), "--chdir", "/tmp",
                "--clearenv", "--setenv", "PATH", image.path, "--setenv", "HOME", "/tmp"]
        if support.own_uid:
            uid = job_uid(settings, job_id)
            args += ["--", *image_box.host_setpriv(SETPRIV)[1], f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return subprocess.run([*args, "--", *argv], capture_output=True, text=True,
                              timeout=image_box.CHECK_TIMEOUT_S, env=LAUNCH_ENV)

    return image_box.check(image, probe, builtin=builtin)


def _offline_names(run_dir: Path) -> list[str]:
    """A private network has no DNS: names resolve from the hosts file alone, which knows this host and localhost
    on both families. Else every lookup waits on an unreachable resolver and fails "temporary" (EAI_AGAIN), and
    c10d warns in every job's log that "the hostname of the client socket cannot be retrieved", which a bare
    torchrun on the same host never prints."""
    etc = run_dir / "etc"
    etc.mkdir(exist_ok=True)
    host = socket.gethostname()
    (etc / "hosts").write_text(f"127.0.0.1 localhost {host}\n::1 localhost ip6-localhost {host}\n")
    (etc / "nsswitch.conf").write_text("hosts: files\n")
    for name in ("hosts", "nsswitch.conf"):
        (etc / name).chmod(0o644)
    return ["--ro-bind", str(etc / "hosts"), "/etc/hosts", "--ro-bind", str(etc / "nsswitch.conf"),
            "/etc/nsswitch.conf"]


def _python_paths(python: str) -> list[str]:
    """The Python the job runs on, its venv and the worker's (a job venv layers on it), trainjobs' packages."""
    prefix = Path(python).parent.parent
    paths = {sys.base_prefix, sys.prefix, str(prefix), *(str(Path(m.__file__).parent) for m in (trainjobs, worker))}
    cfg = prefix / "pyvenv.cfg"
    if cfg.is_file():  # a job venv's own base
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                paths.add(str(Path(value.strip()).parent))
    return sorted(p for p in paths if not p.startswith("/usr/") and os.path.exists(p))


def _data_mounts(settings: Settings, attempt: Attempt) -> list[str]:
    """The data dir's datasets read-only (not the service's own parts of it), then the job's folders."""
    data = settings.data_dir.resolve()
    hidden = settings.service_paths
    args = _contents(data, skip=hidden)
    if attempt.scripts_dir.is_dir() and not attempt.scripts_dir.is_relative_to(data):
        args += _contents(attempt.scripts_dir, skip=hidden)
    args += ["--bind", str(attempt.run_dir), str(attempt.run_dir)]
    job_dir = attempt.job_dir
    args += ["--ro-bind", str(job_dir), str(job_dir)]
    for sub in ("checkpoints", "artifacts"):
        args += ["--bind", str(job_dir / sub), str(job_dir / sub)]
    if attempt.init_from is not None and attempt.init_fd is not None:  # what was checked, not a name again
        args += ["--ro-bind-fd", str(attempt.init_fd), str(attempt.init_from)]
    return args


def _contents(folder: Path, *, skip: set[Path]) -> list[str]:
    """Each entry of `folder` read-only at its own path, but those in `skip`.

    NOTE: entry by entry, not the folder: its parent is then bwrap's own (0755), so a job's uid reaches what it
    may read even where the folder itself is 0700 (pytest's, or an operator's); and a service file added to
    the folder later is not shown by default. A folder of more than MAX_ENTRIES is bound whole instead, with
    the skipped entries hidden under an empty tmpfs (or /dev/null for a file).
    """
    if not folder.is_dir():
        return []
    entries = sorted(folder.iterdir())
    if len(entries) > MAX_ENTRIES:
        args = ["--ro-bind", str(folder), str(folder)]
        for path in (p for p in entries if p in skip):
            args += ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
        return args
    args = ["--perms", "0755", "--dir", str(folder)]
    for path in entries:
        if path not in skip and not any(path == s or path.name.startswith(f"{s.name}-") and path.parent == s.parent
                                        for s in skip if s.suffix == ".db"):
            args += ["--ro-bind", str(path), str(path)]
    return args


def hand_over(support: Support, settings: Settings, attempt: Attempt) -> None:
    """Give the job's uid its folders (a root worker): the run dir, and the job's checkpoints and artifacts.

    Mode 0750 (and the job's umask 027): no other job's uid can read them, the service (root, or the worker's
    uid) still can, and so can a later job of its owner that starts from its weights (init_from lends the group).
    """
    if not support.own_uid:
        return
    uid = job_uid(settings, attempt.job_id)
    for top in (attempt.run_dir, attempt.job_dir / "checkpoints", attempt.job_dir / "artifacts"):
        if top.stat().st_uid == uid and top != attempt.run_dir:
            continue  # already the job's (an earlier attempt): no walk over a large checkpoint tree
        for path in (top, *top.rglob("*")):
            os.lchown(path, uid, uid)
        top.chmod(0o750)


_current: Support | None = None
_detected: dict[tuple, Support] = {}


def for_worker(settings: Settings) -> Support:
    """This process's Support: the worker's (set at its start, worker/main.py), else detected once per setting."""
    if _current is not None:
        return _current
    key = (settings.sandbox, settings.job_network)
    if key not in _detected:
        _detected[key] = detect(settings)
    return _detected[key]


def set_current(support: Support) -> None:
    global _current
    _current = support


def gpu_nodes() -> tuple[str, ...]:
    """The GPU device nodes of this machine: the job of a worker that runs one job at a time gets them all."""
    dev = Path("/dev")
    numbered = sorted(str(p) for p in dev.glob("nvidia[0-9]*"))
    return (*numbered, *(str(dev / n) for n in GPU_SHARED_NODES if (dev / n).exists()))


def default_memory_bytes() -> int:
    """An attempt's memory bound unless TRAINJOBS_JOB_MEMORY_BYTES says otherwise: the host's, less what the
    worker and the system keep (2 GiB, or a quarter of a small host), so a job that fills memory is the one the
    kernel kills, never its worker."""
    total = psutil.virtual_memory().total
    return max(total - 2 * 2**30, total * 3 // 4)


def _args_fd(args: list[str]) -> int:
    """A descriptor bwrap reads `args` from (--args FD: NUL-separated), at its start."""
    fd = os.memfd_create("trainjobs-bwrap-args", os.MFD_CLOEXEC)  # pass_fds hands it on all the same
    data = b"".join(os.fsencode(a) + b"\0" for a in args)
    while data:
        data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Box:
    """One attempt in its sandbox and cgroup: the command to launch, the preexec_fn, and the teardown."""

    def __init__(self, support: Support, settings: Settings, attempt: Attempt, *, memory_bytes: int | None,
                 cpus: list[int] | None = None):
        self.support, self.settings, self.attempt = support, settings, attempt
        self.cgroup: cgroups.Attempt | None = None
        self.pass_fds: tuple[int, ...] = ()  # what bwrap reads by descriptor: init_from's weights, the job's env
        self.memory_bytes = settings.job_memory_bytes or memory_bytes
        if support.cgroup:
            cgroups.sweep_stale()  # an earlier attempt's, whose work-horse was killed before it removed its own
            group = cgroups.Attempt(cgroups.new_name())  # opaque: a job that saw the tree learns no job id from it
            log.info("attempt %s of job %s: cgroup %s", attempt.run_dir.name, attempt.job_id, group.name)
            pids_max = settings.job_pids_max or cgroups.default_pids_max(settings.worker_max_jobs)
            try:
                group.create(memory_bytes=self.memory_bytes, pids_max=pids_max, cpus=cpus)
                self.cgroup = group
            except OSError:
                log.exception("could not make the cgroup of %s; running it without limits", attempt.job_id)
                group.remove()

    @property
    def umask(self) -> int:
        return 0o027 if self.support.on else -1  # what the job writes is not for other uids

    def wrap(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        env = {**env, "HOME": str(self.attempt.run_dir / "home")}
        (self.attempt.run_dir / "home").mkdir(exist_ok=True)
        if not self.support.on:
            return argv, env
        if self.attempt.image is not None:  # its PATH finds its python3; its own libraries, not the host's
            env = image_box.job_env(env, self.attempt.image, self.attempt.devices)
        if not self.attempt.gang and self.support.network == "private":
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback is all there is: gloo and NCCL must bind it
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        hand_over(self.support, self.settings, self.attempt)
        if self.attempt.init_from is not None and self.attempt.init_job is not None:
            self.pass_fds = (lend_init_source(self.support, self.settings, self.attempt.init_job,
                                              self.attempt.init_from),)
            self.attempt = replace(self.attempt, init_fd=self.pass_fds[0])
        # bwrap keeps the run tag: the worker finds an attempt's processes by it (worker/processes.py), bwrap too.
        tag = {RUN_TAG_ENV: env[RUN_TAG_ENV]} if RUN_TAG_ENV in env else {}
        # The job's variables reach bwrap through a descriptor (--args), not its command line, where any user of
        # the host could read them (ps): a spec's env may hold a job's own tokens.
        wrapped = command(self.support, self.settings, self.attempt, argv)
        env_fd = _args_fd(["--clearenv", *(arg for name, value in env.items() for arg in ("--setenv", name, value))])
        self.pass_fds = (*self.pass_fds, env_fd)
        return [wrapped[0], "--args", str(env_fd), *wrapped[1:]], {**LAUNCH_ENV, **tag}

    def launched(self) -> None:
        """bwrap has its copies of the descriptors it reads: the worker's are closed."""
        for fd in self.pass_fds:
            os.close(fd)
        self.pass_fds = ()

    def preexec(self) -> None:
        """In the forked child, before it execs bwrap: every process of the attempt starts in the cgroup."""
        if self.cgroup is not None:
            self.cgroup.join()

    def oom_killed(self) -> bool:
        return self.cgroup is not None and self.cgroup.oom_killed()

    def close(self) -> None:
        self.launched()
        if self.attempt.image is not None:
            self.attempt.image.release()
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()
