"""Keep a process's secrets from the other processes of its uid, such as the ranks of users' jobs.

Any process can read /proc/<pid>/environ (the initial environment: deleting a variable from os.environ does
not change it) and /proc/<pid>/mem of a process of its own uid, or ptrace it, unless that process is not
dumpable (prctl PR_SET_DUMPABLE 0): then only root (CAP_SYS_PTRACE) can. The flag is inherited by a fork (RQ's
work-horse) and reset by an exec, so torchrun and the ranks are dumpable again (the worker still reads their
run tags) and hold only the scrubbed environment of worker/launch.py. Files are another matter: a process
reads every file its uid may read (the README's "What a job can reach").
"""

import ctypes
import os
import sys

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """Make this process (and the children it forks without exec) not dumpable; whether it now is not."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    return libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0


def start_resource_tracker_scrubbed(prefix: str = "TRAINJOBS_") -> None:
    """Start multiprocessing's resource tracker now, without this process's prefix* variables (the database
    URL among them). It is exec'd, so dumpable whatever this process is, and lives as long as this process;
    uvicorn --workers N starts it with its first worker, handing it the whole environment. It needs none of it."""
    from multiprocessing import resource_tracker

    # NOTE: the tracker is exec'd with the C environ, which os.environ's pop/update keep in step (unsetenv).
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(prefix)}
    try:
        resource_tracker.ensure_running()
    finally:
        os.environ.update(saved)
