"""An attempt's cgroup holds it to the cores it was placed on: the job cannot widen its own affinity past them."""

import os
import subprocess
import sys

import pytest

from worker import cgroups

WIDEN = "import os; os.sched_setaffinity(0, range(os.cpu_count())); print(sorted(os.sched_getaffinity(0)))"


def cpuset_attempt(name: str, cpus: list[int]) -> cgroups.Attempt:
    group = cgroups.Attempt(name)
    try:
        group.create(memory_bytes=2**30, pids_max=64, cpus=cpus)
    except OSError as exc:
        group.remove()
        pytest.skip(f"this machine cannot make cgroups: {exc}")
    if not group.cpuset:
        group.remove()
        pytest.skip("no cpuset controller here")
    return group


def test_a_process_in_an_attempts_cgroup_cannot_widen_its_affinity_past_its_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to widen to")
    core = max(os.sched_getaffinity(0))
    group = cpuset_attempt(f"tj-test-cpuset-{os.getpid()}", [core])
    try:
        out = subprocess.run([sys.executable, "-c", WIDEN], preexec_fn=group.join, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert out.strip() == f"[{core}]"
    finally:
        group.kill()
        group.remove()
    assert not any(d.exists() for d in group.dirs)

