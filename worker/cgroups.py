"""A cgroup per attempt, where the worker may make one: a bound on its memory and its processes, the cores it was
placed on (cpuset, where that controller is there: a job cannot widen its own affinity past them), and a way to
kill all of it at once. Both cgroup versions: v1 (a hierarchy per controller, as on older hosts and this CI
machine) and v2 (one unified tree, most hosts now), each found at /sys/fs/cgroup.

On v2 a child cgroup needs its controllers enabled in its parent's cgroup.subtree_control, which the kernel
refuses while the parent itself holds processes (the "no internal processes" rule) unless the parent is the
root: a worker in a systemd service or a container should be given a delegated subtree (systemd Delegate=yes).
Where that fails the worker says so (no cgroup limits) and the PID namespace still ends every process.
"""

import logging
import os
import secrets
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)
ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids")  # needed; cpuset is used where it is there
PARENT = "trainjobs"
PID_MAX = Path("/proc/sys/kernel/pid_max")
PIDS_SHARE = 8  # an attempt's default pids.max: this share of the host's and of the worker's cgroup's (or lanes')
PIDS_FLOOR = 1024  # ... but never fewer: torchrun, 8 ranks' threads and their data loaders


def new_name() -> str:
    """An attempt's cgroup name: random, so the tree names no job (which job it holds is the worker's to know,
    in its log and its Box), then the work-horse's pid, by which sweep_stale finds the left-over ones."""
    return f"a{secrets.token_hex(8)}-{os.getpid()}"


def default_pids_max(lanes: int = 1) -> int:
    """An attempt's processes and threads, sized to the host: 1/max(PIDS_SHARE, lanes) of kernel.pid_max and of
    the worker's own cgroup's pids.max where an ancestor caps it, at least PIDS_FLOOR. A fixed 16,384 on a host
    whose pid_max is 32,768 let two attempts take every pid of the host."""
    share = max(PIDS_SHARE, lanes)
    caps = [_read_int(PID_MAX)]
    caps += [_read_int(d / "pids.max") for d in _own_pids_cgroups()]
    capped = [c for c in caps if c is not None]
    return max(PIDS_FLOOR, min(capped) // share) if capped else PIDS_FLOOR * 16


def _own_pids_cgroups() -> list[Path]:
    """The worker's pids cgroup and its ancestors (below the root, which has no pids.max)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if version() == "v2" and controllers == "" or version() == "v1" and "pids" in controllers.split(","):
            base = ROOT if version() == "v2" else ROOT / controllers
            own = base / path.lstrip("/")
            return [own, *(p for p in own.parents if p.is_relative_to(base) and p != base)]
    return []


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no cap


def detect() -> str | None:
    """"v1" or "v2" when this worker can make a limited cgroup for an attempt, else None."""
    probe = Attempt(f"probe-{os.getpid()}")
    try:
        probe.create(memory_bytes=2**30, pids_max=64)
    except OSError as exc:
        log.info("no cgroup limits for attempts: %s", exc)
        return None
    finally:
        probe.remove()
    return probe.version


def version() -> str | None:
    if (ROOT / "cgroup.controllers").exists():
        return "v2"
    if all((ROOT / c).is_dir() for c in V1_CONTROLLERS):
        return "v1"
    return None


def _own_v2() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return ROOT / line[3:].lstrip("/")
    raise OSError("no cgroup v2 entry in /proc/self/cgroup")


def sweep_stale() -> list[str]:
    """Remove the empty cgroups of attempts whose work-horse is gone (killed, or the kernel was slow to let the
    folder go): each is named after its horse's pid. Returns the names removed."""
    removed = []
    for parent in _parents():
        try:
            children = [d for d in parent.iterdir() if d.is_dir()]
        except OSError:
            continue
        for d in children:
            pid = d.name.rpartition("-")[2]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                if not (d / "cgroup.procs").read_text().split():
                    d.rmdir()
                    removed.append(d.name)
            except OSError:
                pass  # a process still in it, or going: the next sweep
    return removed


def _parents() -> list[Path]:
    if version() == "v1":
        return [ROOT / c / PARENT for c in (*V1_CONTROLLERS, "cpuset")]
    if version() == "v2":
        try:
            return [_own_v2() / PARENT]
        except OSError:
            return []
    return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Attempt:
    """One attempt's cgroup(s): make it, put the launcher in it (before exec), kill and remove it at the end."""

    def __init__(self, name: str):
        self.name = name.replace("/", "_")
        self.version = version()
        self.dirs: list[Path] = []
        self.cpuset = False  # whether the kernel holds the attempt to its cores

    def create(self, *, memory_bytes: int | None, pids_max: int, cpus: list[int] | None = None) -> None:
        if self.version == "v1":
            self.dirs = [ROOT / c / PARENT / self.name for c in V1_CONTROLLERS]
            for d in self.dirs:
                d.mkdir(parents=True, exist_ok=True)
            memory, pids = self.dirs
            if memory_bytes:
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            (pids / "pids.max").write_text(str(pids_max))
            if cpus and (ROOT / "cpuset" / "cpuset.cpus").exists():
                try:
                    self.dirs.append(_v1_cpuset(self.name, cpus))
                    self.cpuset = True
                except OSError as exc:  # the bounds above still hold; the affinity alone keeps the cores
                    log.warning("no cpuset for %s: %s", self.name, exc)
        elif self.version == "v2":
            parent = _own_v2() / PARENT
            parent.mkdir(exist_ok=True)
            wanted = "+memory +pids"
            if cpus and "cpuset" in (parent.parent / "cgroup.controllers").read_text().split():
                wanted += " +cpuset"
            (parent.parent / "cgroup.subtree_control").write_text(wanted)
            (parent / "cgroup.subtree_control").write_text(wanted)
            d = parent / self.name
            d.mkdir(exist_ok=True)
            self.dirs = [d]
            if memory_bytes:
                (d / "memory.max").write_text(str(memory_bytes))
                if (d / "memory.swap.max").exists():  # the bound is on memory, not memory + swap
                    (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(pids_max))
            if "+cpuset" in wanted:
                try:
                    (d / "cpuset.cpus").write_text(_cpu_list(cpus))
                    self.cpuset = True
                except OSError as exc:
                    log.warning("no cpuset for %s: %s", self.name, exc)
        else:
            raise OSError("no cgroup hierarchy with memory and pids controllers at /sys/fs/cgroup")

    def join(self) -> None:
        """preexec_fn: move the calling (forked, not yet exec'd) process into the cgroup(s)."""
        pid = str(os.getpid()).encode()
        for d in self.dirs:
            fd = os.open(d / "cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return found

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the attempt for its memory bound."""
        for d in self.dirs:
            for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                try:
                    for line in (d / name).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key and int(v) > 0:
                            return True
                except (OSError, ValueError):
                    pass
        return False

    def kill(self) -> None:
        """SIGKILL everything in it (cgroup.kill on v2; on v1 each process, until none is left)."""
        if self.version == "v2" and self.dirs and (self.dirs[0] / "cgroup.kill").exists():
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(50):
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(20):  # the last processes may still be exiting
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(set(cpus)))


def _v1_cpuset(name: str, cpus: list[int]) -> Path:
    """A v1 cpuset child holding `cpus`. A new v1 cpuset starts with no cores and no memory nodes, and a
    process cannot join it until both are set, so the parent first gets the root's (once)."""
    root, parent = ROOT / "cpuset", ROOT / "cpuset" / PARENT
    parent.mkdir(exist_ok=True)
    for key in ("cpuset.cpus", "cpuset.mems"):
        if not (parent / key).read_text().strip():
            (parent / key).write_text((root / key).read_text().strip())
    d = parent / name
    d.mkdir(exist_ok=True)
    (d / "cpuset.mems").write_text((parent / "cpuset.mems").read_text().strip())
    (d / "cpuset.cpus").write_text(_cpu_list(cpus))
    return d
