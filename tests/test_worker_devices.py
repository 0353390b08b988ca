"""The worker's inventory (worker/devices.py) on fake nvidia-smi output: GPUs by UUID, the links, a worker per group
of GPUs under CUDA_VISIBLE_DEVICES, an unhealthy GPU, and CPU slots from the worker's affinity."""

import os

from worker import devices

QUERY = "0, GPU-aaaa, 81559, 00000000:07:00.0\n1, GPU-bbbb, 81559, 00000000:0F:00.0\n2, GPU-cccc, [N/A], " \
        "00000000:47:00.0\n3, GPU-dddd, 81559, 00000000:4E:00.0\n"
TOPO = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\t0-7\t0
GPU1\tNV4\t X \tSYS\tSYS\t0-7\t0
GPU2\tSYS\tSYS\t X \tNV4\t8-15\t1
GPU3\tSYS\tSYS\tNV4\t X \t8-15\t1
"""


def fake_nvidia_smi(folder) -> None:
    (folder / "query.txt").write_text(QUERY)
    (folder / "topo.txt").write_text(TOPO)
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nif [ \"$1\" = topo ]; then cat {folder}/topo.txt; else cat {folder}/query.txt; fi\n")
    exe.chmod(0o755)


def test_a_gpu_machine_is_read_with_uuids_links_numa_and_an_unhealthy_gpu_named(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine = devices.gpu_machine("w1")
    assert [d.uuid for d in machine.devices] == ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]
    assert not machine.devices[2].healthy and "N/A" in machine.devices[2].reason
    assert str(machine.link(0, 1)) == "NV4" and str(machine.link(1, 3)) == "SYS"
    assert machine.devices[3].numa_node == 1
    share = devices.share(machine, [0, 1])
    assert share["visible"] == "GPU-aaaa,GPU-bbbb" and share["cores"] == list(range(8))
    rows = devices.as_rows(machine)
    assert rows[0]["uuid"] == "GPU-aaaa" and rows[0]["memory_bytes"] == 81559 * 2**20 and not rows[2]["healthy"]


def test_a_worker_started_under_cuda_visible_devices_offers_only_those_gpus(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-bbbb")
    assert [d.uuid for d in devices.gpu_machine("w1").devices] == ["GPU-dddd", "GPU-bbbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,2")  # CUDA stops at an entry it cannot resolve
    assert [d.index for d in devices.gpu_machine("w1").devices] == [1]


def test_a_cpu_machine_splits_the_workers_cores_into_its_slots():
    cores = sorted(os.sched_getaffinity(0))
    machine = devices.cpu_machine("w1", len(cores))
    assert sorted(c for d in machine.devices for c in d.cores) == cores
    assert all(len(d.cores) == 1 for d in machine.devices)
    more = devices.cpu_machine("w1", len(cores) * 2)  # more slots than cores: they share, round robin
    assert len(more.devices) == 2 * len(cores) and {c for d in more.devices for c in d.cores} == set(cores)
