"""Which worker a job goes to by NVLink (issue 30): the worker labels its largest NVLink island, best fit breaks
its ties by it (pool.nvlink_preference), a one-node job that fills an island waits for one (pool.island_floor,
TRAINJOBS_NVLINK_WHOLE_JOBS), and bench/device_sim.py measures those same rules. Pure: no stack."""

import os
from pathlib import Path

import pytest

from bench import device_sim
from service.scheduling import service as scheduling
from service.scheduling.placement import Device, Level, Link, Machine, cpu_machine, machine_from_topo, nvlink_island
from service.scheduling.policy import Node, Running, Settings, Snapshot, Waiting, plan
from service.scheduling.pool import island_floor, nvlink_preference
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


def job(job_id: str, gpus: int, submitted: float = 0.0, *, nodes: int = 1, selector: dict | None = None,
        memory: int | None = None, priority: str = "normal") -> Waiting:
    need = Need("cuda", gpus, memory, "cuda" if memory else None, labels=selector or {}, nodes=nodes)
    return Waiting(job_id, "alice", priority, priority, submitted, submitted, need, 3600.0)


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


# --- a one-node job that fills an island waits for one (pool.island_floor) ---

NOW = 10_000.0


def test_only_a_one_node_job_that_fills_the_largest_island_is_held_to_it():
    assert island_floor(8, 1, [8, 0, 0]) == 8  # an 8-GPU job on a fleet of DGX and PCIe machines
    assert island_floor(4, 1, [4, 0]) == 4  # a 4-GPU job where the islands are NVLink quads
    # Smaller than the largest island: nvlink_preference sends it off NVLink on purpose, so it is never held there.
    assert island_floor(4, 1, [8, 0]) == island_floor(2, 1, [8, 0]) == island_floor(1, 1, [1, 0]) == 0
    assert island_floor(8, 1, [0, 0]) == island_floor(8, 1, []) == 0  # no island anywhere: it runs where it fits
    assert island_floor(8, 2, [8, 8, 0]) == 0  # a gang's nodes talk over the network anyway: it only prefers one


def busy_nvlink_and_free_pcie() -> tuple[list[Node], list[Running]]:
    """w1, the DGX, runs a 5-GPU job that ends in 3,000 s (3 GPUs free); w2, a PCIe machine, is idle."""
    running = [Running("five", "bob", "normal", 5, 1, NOW - 600, 3600.0, ("w1",))]
    return [Node("w1", "cuda", 8, labels={NVLINK_ISLAND_LABEL: "8"}, running="five", room=3),
            gpu_node("w2", 0)], running


def test_an_8_gpu_job_waits_for_the_nvlink_machine_rather_than_take_the_free_pcie_one():
    nodes, running = busy_nvlink_and_free_pcie()
    result = plan(Snapshot(NOW, [job("eight", 8)], running, nodes))
    place = result.place("eight")
    assert place.workers == []
    assert place.reason == "needs 8 GPUs on one NVLink island; every worker with one is busy (w1: 3 free)"
    assert place.estimated_start == NOW + 3000  # when the job on the DGX ends
    # The PCIe machine stays open to the jobs that do not fill an island, behind it in the queue or not.
    both = plan(Snapshot(NOW, [job("eight", 8, 0.0), job("four", 4, 1.0)], running, nodes))
    assert {p.job_id: p.workers for p in both.order} == {"eight": [], "four": ["w2"]}


def test_with_the_setting_off_the_8_gpu_job_takes_the_free_pcie_machine_as_before(tmp_path, monkeypatch):
    nodes, running = busy_nvlink_and_free_pcie()
    monkeypatch.setenv("TRAINJOBS_NVLINK_WHOLE_JOBS", "false")
    settings = scheduling.policy_settings(ServiceSettings(data_dir=tmp_path))
    assert settings.nvlink_whole_jobs is False and Settings().nvlink_whole_jobs is True  # on by default
    result = plan(Snapshot(NOW, [job("eight", 8)], running, nodes, settings=settings))
    assert result.place("eight").workers == ["w2"]


def test_a_pcie_only_fleet_still_runs_an_8_gpu_job():
    assert assigned([gpu_node("w1", 0, room=3), gpu_node("w2", 0)], job("eight", 8)) == {"eight": ["w2"]}
    # Nor does a DGX that the job does not fit otherwise (too little memory per GPU) hold it back.
    small = Node("w3", "cuda", 8, memory_bytes=40 * 2**30, labels={NVLINK_ISLAND_LABEL: "8"}, room=8)
    big = Node("w4", "cuda", 8, memory_bytes=80 * 2**30, labels={NVLINK_ISLAND_LABEL: "0"}, room=8)
    assert assigned([small, big], job("eight", 8, memory=60 * 2**30)) == {"eight": ["w4"]}


def test_a_4_gpu_job_takes_the_nvlink_machine_rather_than_wait_for_a_pcie_one():
    assert assigned([gpu_node("w1", 8), gpu_node("w2", 0, room=2)], job("four", 4)) == {"four": ["w1"]}


def test_a_gang_of_8_gpu_nodes_runs_on_pcie_machines_while_the_dgx_is_busy():
    nodes = [gpu_node("w1", 8, room=3), gpu_node("w2", 0), gpu_node("w3", 0)]
    assert assigned(nodes, job("gang", 8, nodes=2)) == {"gang": ["w2", "w3"]}


def test_a_selector_wins_over_the_rule():
    nodes = [gpu_node("w1", 8), Node("w2", "cuda", 8, labels={NVLINK_ISLAND_LABEL: "0", "zone": "b"}, room=8)]
    assert assigned(nodes, job("eight", 8, selector={"zone": "b"})) == {"eight": ["w2"]}
    # "Run now on PCIe rather than wait for NVLink", said the way a user can.
    assert assigned(nodes, job("eight", 8, selector={NVLINK_ISLAND_LABEL: "0"})) == {"eight": ["w2"]}


def test_a_high_8_gpu_job_preempts_only_on_a_machine_it_may_take():
    # Stopping one job on the PCIe machine w2 would free it; the job may only go to the DGX w1, which takes two.
    running = [Running(r, "carol", "low", 1, 1, NOW - 1000, 3600.0, (w,)) for r, w in
               (("a", "w1"), ("b", "w1"), ("c", "w2"))]
    nodes = [Node("w1", "cuda", 8, labels={NVLINK_ISLAND_LABEL: "8"}, running="a", room=6),
             Node("w2", "cuda", 8, labels={NVLINK_ISLAND_LABEL: "0"}, running="c", room=7)]
    urgent = job("urgent", 8, NOW - 61, priority="high")
    result = plan(Snapshot(NOW, [urgent], running, nodes))
    assert sorted(p.victim for p in result.preemptions) == ["a", "b"]
    assert result.place("urgent").reason.endswith("; preempting 2 lower-priority job(s) on w1 for 8 GPUs")
    old = plan(Snapshot(NOW, [urgent], running, nodes, settings=Settings(nvlink_whole_jobs=False)))
    assert [p.victim for p in old.preemptions] == ["c"]


# --- the simulator measures the same rules ---


def simulate(policy: str, jobs: list[device_sim.Job] | None = None) -> device_sim.Sim:
    """m00 NVLink, m01 PCIe; by default a 1-GPU job, then an 8-GPU job while it runs."""
    devices = [Device(i, f"GPU-{i}") for i in range(8)]
    machines = [machine_from_topo("m00", DGX, devices), machine_from_topo("m01", PCIE, devices)]
    jobs = jobs or [device_sim.Job(0, 0, 1, 3600.0, 0.0), device_sim.Job(1, 0, 8, 3600.0, 60.0)]
    sim = device_sim.Sim(jobs, policy, machines, {"m00": True, "m01": False}, reserve_after_s=float("inf"))
    sim.run()
    return sim


def test_the_simulators_best_fit_keeps_the_nvlink_machine_for_the_8_gpu_job():
    assert simulate("best-fit").local[1][1]  # the 8-GPU job on the NVLink machine
    assert not simulate("best-fit-plain").local[1][1]  # before the rule: the 1-GPU job broke it up
    assert device_sim.nvlink_preference is nvlink_preference  # the production rule itself, not a copy


def test_the_simulators_8_gpu_job_waits_for_the_busy_nvlink_machine_as_production_does():
    jobs = [device_sim.Job(0, 0, 8, 3600.0, 0.0), device_sim.Job(1, 0, 8, 3600.0, 60.0)]
    before, now = simulate("best-fit-order", jobs), simulate("best-fit", jobs)
    assert (before.start[1], before.local[1][1]) == (60.0, False)  # at once, on the PCIe machine
    assert (now.start[1], now.local[1][1]) == (3600.0, True)  # once the first one leaves the NVLink machine
    assert device_sim.island_floor is island_floor
