"""Stages 3 and 4, sandbox and launch: the attempt's box (bwrap's command line, its cgroup), then torchrun in a
session of its own, pinned to its cores, with every process it starts found (worker/processes.py)."""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from service.settings import Settings
from worker import launch, processes, sandbox
from worker.attempt.place import Placed
from worker.attempt.prepare import Code
from worker.shipping import OutputPump


def enclose(settings: Settings, *, job_id: str, run_dir: Path, job_dir: Path, python: str, code: Code,
            placed: Placed, gang: launch.Gang | None) -> sandbox.Box:
    """The attempt's sandbox (where this worker makes one) and its cgroup, bounded to its share's memory."""
    return sandbox.Box(sandbox.for_worker(settings), settings, sandbox.Attempt(
        job_id=job_id, run_dir=run_dir, job_dir=job_dir, python="python3" if code.image else python,
        data_dir=settings.data_dir, scripts_dir=code.scripts_dir,
        cwd=code.code_dir or (Path(code.image.cwd) if code.image and code.image.cwd else run_dir),  # in the image
        init_from=code.init_from, init_job=code.init_job, gang=gang is not None,
        node_rank=gang.node_rank if gang else 0, devices=placed.device_nodes(), image=code.image,
    ), memory_bytes=placed.memory_bytes(sandbox.default_memory_bytes()), cpus=placed.cores)


class Launcher:
    """torchrun's pid, found once under the process launched (a sandbox's bwrap stands between them)."""

    def __init__(self, root_pid: int):
        self.root_pid, self._pid = root_pid, None

    @property
    def pid(self) -> int:
        if self._pid is None:
            found = processes.launcher_pid(self.root_pid)
            try:
                if found == self.root_pid and not processes.is_torchrun(psutil.Process(found)):
                    return found  # not started yet: ask again next time
            except psutil.NoSuchProcess:
                return found
            self._pid = found
        return self._pid


@dataclass
class Launched:
    """One attempt's processes once started: the one launched, all of them, torchrun's pid, their output."""

    proc: subprocess.Popen
    procs: processes.AttemptProcesses
    launcher: Launcher
    pump: OutputPump


def launch_attempt(argv: list[str], env: dict[str, str], *, cwd: Path, box: sandbox.Box, cores: list[int],
                   tag: str) -> Launched:
    """Start `argv` (the box's command line) in a session of its own, so a signal to the worker's terminal never
    reaches the ranks directly; in the box's cgroup and pinned to `cores` (every process of it inherits both).
    Closes the box when it cannot start."""
    processes.become_subreaper()
    procs = processes.AttemptProcesses(tag)  # before torchrun: what exists now is not the attempt's

    def preexec() -> None:
        processes.prepare_torchrun()
        box.preexec()
        if cores:
            os.sched_setaffinity(0, cores)

    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec,
                                umask=box.umask, pass_fds=box.pass_fds)
    except BaseException:
        box.close()
        raise
    box.launched()
    procs.root_pid = proc.pid
    return Launched(proc, procs, Launcher(proc.pid), OutputPump(proc.stdout.fileno()))
