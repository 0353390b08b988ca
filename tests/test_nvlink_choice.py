"""Which worker a job goes to by NVLink (issue 30): the worker labels its largest NVLink island, best fit breaks
its ties by it (pool.nvlink_preference), and bench/device_sim.py measures that same rule. Pure: no stack."""

import os
from pathlib import Path

import pytest

from bench import device_sim
from service.scheduling.placement import Device, Level, Link, Machine, cpu_machine, machine_from_topo, nvlink_island
from service.scheduling.policy import Node, Settings, Snapshot, Waiting, plan
from service.scheduling.pool import nvlink_preference
from service.settings import Settings as ServiceSettings
from service.workers.fit import NVLINK_ISLAND_LABEL, Need
from worker import inventory

TOPO = Path(__file__).parent / "fixtures" / "topo"
DGX = (TOPO / "dgx_h100_nvlink_8gpu.txt").read_text()  # every pair NV18
PCIE = (TOPO / "pcie_4x4_dual_socket.txt").read_text()  # PIX pairs, NODE in a socket, SYS across: no NVLink
GPUS = [Device(i, f"GPU-{i:04x}") for i in range(8)]


def linked(pairs: dict[tuple[int, int], Link], n: int) -> Machine:
    return Machine("w", "cuda", tuple(GPUS[:n]), pairs)


# --- the label: the worker's largest NVLink island ---


def test_a_dgx_is_one_island_of_8_and_a_pcie_node_has_none():
    assert nvlink_island(machine_from_topo("dgx", DGX, GPUS)) == 8
    assert nvlink_island(machine_from_topo("pcie", PCIE, GPUS)) == 0


def test_the_island_is_the_largest_set_all_linked_to_each_other_not_a_chain():
    nv = Link(Level.NV, 4)
    # 0-1-2 a triangle, 2-3 and 3-4 pairs: a chain of five reaches every GPU, but only three link each to each.
    pairs = {(0, 1): nv, (1, 2): nv, (0, 2): nv, (2, 3): nv, (3, 4): nv, (0, 4): Link(Level.PIX)}
    assert nvlink_island(linked(pairs, 5)) == 3
    assert nvlink_island(linked({(0, 1): nv, (2, 3): nv}, 4)) == 2  # two NVLink pairs (a 4-GPU board)
    assert nvlink_island(linked({}, 8)) == 0  # no topology read: no NVLink counted on


def test_a_gpu_worker_labels_its_island_and_a_cpu_worker_does_not():
    assert inventory.topology_labels(machine_from_topo("dgx", DGX, GPUS)) == {NVLINK_ISLAND_LABEL: "8"}
    assert inventory.topology_labels(machine_from_topo("pcie", PCIE, GPUS)) == {NVLINK_ISLAND_LABEL: "0"}
    assert inventory.topology_labels(cpu_machine("cpu", range(4))) == {}


def test_probe_offers_the_island_label_from_nvidia_smi_topo(tmp_path, monkeypatch):
    (tmp_path / "topo.txt").write_text(DGX)
    (tmp_path / "query.txt").write_text("".join(f"{i}, GPU-{i:04x}, 81559, 0000:{i:02x}:00.0\n" for i in range(8)))
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\ncase "$1" in topo) cat {tmp_path}/topo.txt ;; --query-gpu=memory.total) '
                   f'for i in 1 2 3 4 5 6 7 8; do echo 81559; done ;; *) cat {tmp_path}/query.txt ;; esac\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    offer = inventory.probe(ServiceSettings(data_dir=tmp_path / "data", worker_address="10.0.0.1"), name="dgx")
    assert offer.device == "cuda" and offer.slots == 8
    assert offer.labels[NVLINK_ISLAND_LABEL] == "8"


def test_the_island_label_is_the_workers_own_not_a_users():
    with pytest.raises(ValueError, match="worker's own"):
        inventory.parse_labels(f"{NVLINK_ISLAND_LABEL}=8")


# --- the rule ---


def test_a_job_smaller_than_an_island_goes_where_it_breaks_none():
    assert nvlink_preference(1, 0) < nvlink_preference(1, 2) < nvlink_preference(1, 8)
    assert nvlink_preference(4, 0) < nvlink_preference(4, 8)


def test_a_multi_gpu_job_prefers_an_island_that_holds_it_whole():
    assert nvlink_preference(8, 8) < nvlink_preference(8, 0)
    assert nvlink_preference(2, 2) < nvlink_preference(2, 0)  # an NVLink pair it fills: breaks nothing
    assert nvlink_preference(4, 4) < nvlink_preference(4, 2) < nvlink_preference(4, 0)  # more of it on NVLink


# --- policy.plan: best fit, ties by NVLink ---


def gpu_node(node_id: str, island: int | None, room: int = 8) -> Node:
    labels = {} if island is None else {NVLINK_ISLAND_LABEL: str(island)}
    return Node(node_id, "cuda", 8, labels=labels, running="busy" if room < 8 else None, room=room)


def job(job_id: str, gpus: int, submitted: float = 0.0) -> Waiting:
    return Waiting(job_id, "alice", "normal", "normal", submitted, submitted, Need("cuda", gpus, None, None), 3600.0)


def assigned(nodes: list[Node], *jobs: Waiting) -> dict[str, list[str]]:
    result = plan(Snapshot(10_000.0, list(jobs), [], nodes, settings=Settings()))
    return {p.job_id: p.workers for p in result.order}


@pytest.mark.parametrize("nv_id, pcie_id", [("w1", "w2"), ("w2", "w1")])  # whichever the id order would pick
def test_on_two_free_workers_a_1_gpu_job_takes_the_pcie_one_and_an_8_gpu_job_the_nvlink_one(nv_id, pcie_id):
    nodes = [gpu_node(nv_id, 8), gpu_node(pcie_id, 0)]
    assert assigned(nodes, job("one", 1)) == {"one": [pcie_id]}
    assert assigned(nodes, job("eight", 8)) == {"eight": [nv_id]}
    # Both at once: the small job first in the queue no longer leaves the 8-GPU job only the PCIe machine.
    assert assigned(nodes, job("one", 1, 0.0), job("eight", 8, 1.0)) == {"one": [pcie_id], "eight": [nv_id]}


def test_with_the_pcie_machine_full_a_1_gpu_job_takes_the_nvlink_one_rather_than_wait():
    nodes = [gpu_node("w1", 0, room=0), gpu_node("w2", 8)]
    assert assigned(nodes, job("one", 1)) == {"one": ["w2"]}


def test_the_fewest_free_gpus_left_still_comes_first():
    # The NVLink machine is broken already (one GPU free): packing the job there keeps the PCIe machine whole.
    nodes = [gpu_node("w1", 0), gpu_node("w2", 8, room=1)]
    assert assigned(nodes, job("one", 1)) == {"one": ["w2"]}


def test_a_worker_without_the_label_counts_as_no_nvlink():
    nodes = [gpu_node("w1", 8), gpu_node("w2", None)]
    assert assigned(nodes, job("one", 1)) == {"one": ["w2"]}
    assert assigned(nodes, job("eight", 8)) == {"eight": ["w1"]}


# --- the simulator measures the same rule ---


def simulate(policy: str) -> device_sim.Sim:
    """m00 NVLink, m01 PCIe; a 1-GPU job, then an 8-GPU job while it runs."""
    devices = [Device(i, f"GPU-{i}") for i in range(8)]
    machines = [machine_from_topo("m00", DGX, devices), machine_from_topo("m01", PCIE, devices)]
    jobs = [device_sim.Job(0, 0, 1, 3600.0, 0.0), device_sim.Job(1, 0, 8, 3600.0, 60.0)]
    sim = device_sim.Sim(jobs, policy, machines, {"m00": True, "m01": False}, reserve_after_s=float("inf"))
    sim.run()
    return sim


def test_the_simulators_best_fit_keeps_the_nvlink_machine_for_the_8_gpu_job():
    assert simulate("best-fit").local[1][1]  # the 8-GPU job on the NVLink machine
    assert not simulate("best-fit-plain").local[1][1]  # before the rule: the 1-GPU job broke it up
    assert device_sim.nvlink_preference is nvlink_preference  # the production rule itself, not a copy
