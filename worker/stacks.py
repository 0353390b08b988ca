"""Every rank's stack, read from outside the rank: `py-spy dump` (all threads, Python frames, the process left
running), so a rank stuck in a collective, a data loader or a C call shows where, without its cooperation.

py-spy reads the target's memory (process_vm_readv): the worker and its ranks share a uid, which is all it needs
unless the kernel's Yama ptrace_scope is 2 or more or the container drops CAP_SYS_PTRACE; then the dump says
why it is empty and the hang is handled all the same.
"""

import logging
import re
import shutil
import subprocess
import sys
import sysconfig
from datetime import UTC, datetime
from pathlib import Path

import psutil

log = logging.getLogger(__name__)
DUMP_TIMEOUT_S = 20.0
TEXT_MAX = 64 * 1024  # per rank
FRAME = re.compile(r"^\s+(?P<function>\S.*?) \((?P<file>.+):(?P<line>\d+)\)$")
THREAD = re.compile(r'^Thread (?P<tid>\w+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?$')  # unnamed without threading


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # installed with the worker (the `worker` extra)
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def ranks_of(torchrun_pid: int) -> list[tuple[int | None, psutil.Process]]:
    """torchrun's children, the ranks, each with its global RANK (from its environment), in rank order."""
    try:
        children = psutil.Process(torchrun_pid).children()
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        found.append((int(rank) if rank and rank.isdigit() else None, child))
    return sorted(found, key=lambda item: (item[0] is None, item[0] or 0))


def dump(torchrun_pid: int, *, reason: str) -> dict:
    """{"reason", "taken_at", "ranks": [{"rank", "pid", "where", "text"}]} for every rank of the attempt."""
    exe = py_spy()
    ranks = []
    for rank, proc in ranks_of(torchrun_pid):
        if exe is None:
            text = "py-spy is not installed on this worker (pip install py-spy): no stack"
        else:
            try:
                done = subprocess.run([exe, "dump", "--pid", str(proc.pid), "--full-filenames"], capture_output=True,
                                      text=True, timeout=DUMP_TIMEOUT_S, errors="replace")
                text = done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr.strip()[-2000:]}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
        ranks.append({"rank": rank, "pid": proc.pid, "where": where(text), "text": text[:TEXT_MAX]})
    return {"reason": reason, "taken_at": datetime.now(UTC).isoformat(), "ranks": ranks}


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def where(text: str) -> str:
    """One line: the main thread's innermost frame, and the innermost frame of the user's own code under it.

    "in all_reduce (torch/distributed/distributed_c10d.py:3252), called from train.py:88"
    """
    threads: list[tuple[str | None, list[tuple[str, str, str]]]] = []
    for line in text.splitlines():
        if thread := THREAD.match(line):
            threads.append((thread["name"], []))
        elif threads and (frame := FRAME.match(line)):
            threads[-1][1].append((frame["function"], frame["file"], frame["line"]))
    main = [frames for name, frames in threads if name == "MainThread"] or [frames for _, frames in threads[:1]]
    frames = main[0] if main else []
    if not frames:
        return "unknown (no Python stack)"
    libraries = _library_roots()

    def own(file: str) -> bool:
        return not file.startswith("<") and "/site-packages/" not in file and not file.startswith(libraries)

    function, file, line = frames[0]
    text = f"in {function} ({short(file)}:{line})"
    if not own(file):
        caller = next(((f, n) for _, f, n in frames[1:] if own(f)), None)
        if caller is not None:
            text += f", called from {short(caller[0])}:{caller[1]}"
    return text


def short(file: str) -> str:
    """A library file from its package on (torch/distributed/...); the user's own by its name."""
    if "/site-packages/" in file:
        return file.rsplit("/site-packages/", 1)[1]
    return Path(file).name


def summary(stacks: dict) -> str:
    return "; ".join(f"rank {r['rank'] if r['rank'] is not None else '?'}: {r['where']}" for r in stacks["ranks"])
