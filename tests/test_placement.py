"""Which devices a job gets on a shared machine (service/scheduling/placement.py): pure, over recorded topologies."""

import time
from itertools import combinations
from pathlib import Path

import pytest

from service.scheduling import placement
from service.scheduling.placement import (
    Device,
    Level,
    Link,
    Machine,
    choose,
    cpu_affinity,
    cpu_machine,
    cpu_slots,
    machine_from_topo,
    parse_affinity,
    parse_cpulist,
    parse_topo,
    place,
    quality,
    visible_devices,
    why_not,
)

TOPO = Path(__file__).parent / "fixtures" / "topo"
DGX = (TOPO / "dgx_h100_nvlink_8gpu.txt").read_text()  # every pair NV18; GPUs 0-3 on NUMA 0, 4-7 on NUMA 1
PCIE = (TOPO / "pcie_4x4_dual_socket.txt").read_text()  # PIX pairs (0,1) (2,3) (4,5) (6,7); NODE in a socket
ALL = set(range(8))
NV18, PIX, NODE, SYS = Link(Level.NV, 18), Link(Level.PIX), Link(Level.NODE), Link(Level.SYS)
GiB = 2**30


def uuid(machine_id: str, i: int) -> str:
    return f"GPU-{machine_id.encode().hex():0>8}-1f2e-3d4c-5b6a-{i:012x}"


def gpus(machine_id: str, text: str, sick: dict[int, str] | None = None) -> Machine:
    """A machine from a recorded topology; `sick`: the GPUs the inventory marks unhealthy, with why."""
    sick = sick or {}
    devices = [Device(i, uuid(machine_id, i), 80 * GiB, healthy=i not in sick, reason=sick.get(i)) for i in range(8)]
    return machine_from_topo(machine_id, text, devices)


def pcie(machine_id: str = "w1", **kw) -> Machine:
    return gpus(machine_id, PCIE, **kw)


def dgx(machine_id: str = "w1") -> Machine:
    return gpus(machine_id, DGX)


def socket(i: int) -> int:
    return i // 4


# --- reading nvidia-smi topo -m ---

def test_parse_topo_reads_the_nvlink_node_every_pair_nv18_and_no_nics():
    links = parse_topo(DGX)
    assert len(links) == 8 * 7  # both orders of the 28 pairs, nothing from the 12 NIC columns or rows
    assert links[0, 1] == links[3, 4] == links[7, 0] == NV18
    assert str(links[2, 6]) == "NV18"


def test_parse_topo_reads_the_pcie_node_pairs_sockets_and_crossings():
    links = parse_topo(PCIE)
    assert len(links) == 56
    assert links[0, 1] == links[1, 0] == links[2, 3] == links[6, 7] == PIX
    assert links[0, 2] == links[1, 3] == links[5, 7] == NODE
    assert links[0, 4] == links[3, 7] == links[6, 1] == SYS


def test_parse_affinity_gives_each_gpu_its_numa_node_and_cores():
    dgx_affinity, pcie_affinity = parse_affinity(DGX), parse_affinity(PCIE)
    assert dgx_affinity[0].numa_node == dgx_affinity[3].numa_node == 0
    assert dgx_affinity[4].numa_node == dgx_affinity[7].numa_node == 1
    assert dgx_affinity[5].cores == tuple(range(56, 112)) + tuple(range(168, 224))
    assert pcie_affinity[2].cores == tuple(range(0, 20)) + tuple(range(40, 60))
    assert pcie_affinity[6].numa_node == 1


def test_parse_topo_tolerates_spaces_for_tabs_escape_codes_and_crlf():
    messy = "\x1b[4m" + PCIE.replace("\t", "   ").replace("\n", "\r\n").replace("GPU7  ", "\x1b[0mGPU7 ", 1)
    assert parse_topo(messy) == parse_topo(PCIE)
    assert parse_affinity(messy) == parse_affinity(PCIE)


def test_parse_affinity_of_a_single_socket_gpu_has_no_numa_node():
    text = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \tPHB\t0-15\tN/A\t\tN/A\n" \
           "GPU1\tPHB\t X \t0-15\tN/A\t\tN/A\n"
    assert parse_topo(text) == {(0, 1): Link(Level.PHB), (1, 0): Link(Level.PHB)}
    assert parse_affinity(text)[1].numa_node is None


def test_parse_topo_refuses_what_is_not_topo_output():
    with pytest.raises(ValueError, match="CPU Affinity"):
        parse_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with pytest.raises(ValueError, match="unknown link"):
        parse_topo("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tWARP9\t0-3\t0\n")


def test_links_rank_nvlink_by_count_then_pcie_then_sockets():
    ranked = [Link.parse(w) for w in ("NV18", "NV12", "NV4", "PIX", "PXB", "PHB", "NODE", "SYS")]
    assert ranked == sorted(ranked, reverse=True)
    assert Link.parse("SOC") == SYS  # the old drivers' name


def test_parse_cpulist_reads_ranges_and_single_cores():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)


# --- choosing devices on one machine ---

def test_nvlink_node_gives_a_two_gpu_job_an_nvlink_pair_and_keeps_the_other_six_usable():
    m = dgx()
    first = choose(m, ALL, 2)
    assert first == (0, 1) and quality(m, first) == NV18
    rest = ALL - set(first)
    four = choose(m, rest, 4)
    assert quality(m, four) == NV18
    assert quality(m, choose(m, rest - set(four), 2)) == NV18


def test_pcie_node_gives_a_two_gpu_job_a_pix_pair():
    assert choose(pcie(), ALL, 2) == (0, 1)
    assert choose(pcie(), {0, 2, 4, 6, 7}, 2) == (6, 7)


def test_pcie_node_never_gives_a_cross_socket_pair_while_a_pix_pair_or_a_socket_pair_is_free():
    m = pcie()
    for size in range(2, 9):
        for free in combinations(range(8), size):
            got = quality(m, choose(m, set(free), 2))
            if any(m.link(a, b) == PIX for a, b in combinations(free, 2)):
                assert got == PIX, free
            elif len({socket(i) for i in free}) < len(free):
                assert got == NODE, free


def test_pcie_node_gives_a_four_gpu_job_one_sockets_four():
    m = pcie()
    assert choose(m, ALL, 4) == (0, 1, 2, 3)
    assert choose(m, ALL - {0}, 4) == (4, 5, 6, 7)
    assert quality(m, choose(m, {0, 1, 2, 4, 5, 6}, 4)) == SYS  # no socket has four: it still runs


def test_one_gpu_job_takes_the_partner_of_a_taken_gpu_rather_than_break_a_free_pair():
    m = pcie()
    for taken in range(8):
        assert choose(m, ALL - {taken}, 1) == (taken ^ 1,), taken


def test_two_gpu_job_takes_the_pair_that_keeps_a_whole_socket_free():
    # Socket 0 is all free, socket 1 has one pair left: the pair goes, so a 4-GPU job still fits on socket 0.
    assert choose(pcie(), {0, 1, 2, 3, 4, 5}, 2) == (4, 5)


def test_unhealthy_gpu_is_never_chosen():
    m = pcie(sick={5: "Xid 79: GPU has fallen off the bus"})
    for size in range(1, 9):
        for free in combinations(range(8), size):
            for n in range(1, size + 1):
                assert 5 not in (choose(m, set(free), n) or ())
    assert choose(m, {4, 5}, 2) is None
    assert choose(m, {4, 5, 6, 7}, 1) == (4,)  # its partner is as lone as a GPU gets


def test_choose_refuses_more_devices_than_are_free_and_a_job_of_none():
    assert choose(dgx(), {1, 2, 3}, 4) is None
    with pytest.raises(ValueError):
        choose(dgx(), ALL, 0)


def test_search_stays_bounded_and_sound_on_sixteen_gpus():
    # 16 GPUs on PCIe: 8 PIX pairs, 4 per socket half (NODE), 2 sockets (SYS): past the exhaustive budget.
    def link(a: int, b: int) -> Link:
        return PIX if a // 2 == b // 2 else NODE if a // 8 == b // 8 else SYS
    m = Machine("big", "cuda", tuple(Device(i, f"GPU-{i}") for i in range(16)),
                {(a, b): link(a, b) for a in range(16) for b in range(16) if a != b})
    started = time.perf_counter()
    assert choose(m, set(range(16)), 8) == tuple(range(8))
    assert choose(m, set(range(16)) - {0, 1, 2, 3}, 8) == tuple(range(8, 16))
    taken_one = choose(m, set(range(16)) - {3}, 6)
    assert quality(m, taken_one) == NODE and 2 in taken_one  # the lone GPU goes first, with its socket
    assert time.perf_counter() - started < 0.5


def test_greedy_search_finds_the_exhaustive_searchs_worst_link_on_both_nodes(monkeypatch):
    machines = [pcie(), dgx()]
    exact = {(i, free, n): choose(m, set(free), n) for i, m in enumerate(machines)
             for size in range(1, 9) for free in combinations(range(8), size) for n in range(1, size + 1)}
    monkeypatch.setattr(placement, "SEARCH_BUDGET", 0)
    for (i, free, n), want in exact.items():
        m = machines[i]
        assert quality(m, choose(m, set(free), n)) == quality(m, want), (m.id, free, n)


# --- across machines ---

def test_best_fit_puts_a_one_gpu_job_on_the_machine_with_one_free_gpu_not_the_empty_one():
    assert place(1, [(dgx("w1"), ALL), (dgx("w2"), {5})]) == ("w2", (5,))


def test_best_fit_puts_a_four_gpu_job_on_the_free_socket_and_keeps_the_empty_machine_whole():
    assert place(4, [(pcie("w1"), ALL), (pcie("w2"), {4, 5, 6, 7})]) == ("w2", (4, 5, 6, 7))


def test_place_skips_a_fragmented_machine_while_another_gives_the_job_its_links():
    # w1 has two GPUs free, one on each socket: a 2-GPU job there would cross sockets; w2 has a PIX pair.
    assert place(2, [(pcie("w1"), {0, 4}), (pcie("w2"), ALL)]) == ("w2", (0, 1))
    assert place(2, [(pcie("w1"), {0, 4})]) == ("w1", (0, 4))  # with nothing better it still runs


def test_place_prefers_the_better_link_when_the_fit_is_equal():
    assert place(2, [(pcie("w1"), {0, 1}), (dgx("w2"), {6, 7})]) == ("w2", (6, 7))


def test_why_not_names_the_largest_free_set():
    machines = [(dgx("w1"), {0, 1}), (pcie("w2"), {0, 1, 2})]
    assert place(4, machines) is None
    assert why_not(4, machines) == "needs 4 GPUs on one node; the largest free set is 3, on w2"
    assert why_not(2, machines) is None


def test_why_not_names_the_unhealthy_gpu_that_keeps_a_job_off_a_machine():
    machines = [(pcie("w1", sick={5: "Xid 79: GPU has fallen off the bus"}), {4, 5, 6, 7}), (dgx("w2"), {0})]
    assert place(4, machines) is None
    assert why_not(4, machines) == ("needs 4 GPUs on one node; the largest free set is 3, on w1; "
                                    "unhealthy: w1 GPU5 (Xid 79: GPU has fallen off the bus)")


def test_why_not_says_when_no_node_is_big_enough():
    assert why_not(16, [(dgx("w1"), ALL)]) == "needs 16 GPUs on one node; the largest free set is 8, on w1; " \
                                              "no node has 16"
    assert why_not(1, []) == "needs 1 GPUs on one node; no machine"


# --- pinning a placed job ---

def test_visible_devices_names_the_chosen_gpus_by_uuid_in_the_chosen_order():
    m = dgx("w1")
    assert visible_devices(m, (6, 2)) == f"{uuid('w1', 6)},{uuid('w1', 2)}"
    assert visible_devices(cpu_machine("c1", range(4)), (0,)) == ""  # a CPU job sees no GPU


def test_cpu_affinity_is_the_cores_of_the_chosen_gpus_numa_nodes():
    m = dgx()
    socket0 = list(range(0, 56)) + list(range(112, 168))
    assert cpu_affinity(m, (0, 1)) == socket0
    assert cpu_affinity(m, (3, 4)) == list(range(224))
    unknown = Machine("w9", "cuda", (Device(0, "GPU-a"), Device(1, "GPU-b")))
    assert cpu_affinity(unknown, (0, 1)) == []  # nothing known: do not pin


# --- CPU machines ---

NUMA2 = {0: list(range(0, 8)), 1: list(range(8, 16))}


def node_of(core: int, numa: dict[int, list[int]]) -> int:
    return next(n for n, cores in numa.items() if core in cores)


def test_cpu_slots_default_to_one_slot_per_core():
    assert cpu_slots([3, 1, 2, 0]) == ((0,), (1,), (2,), (3,))
    assert cpu_slots(range(16), NUMA2) == tuple((c,) for c in range(16))


def test_cpu_slots_split_each_numa_node_evenly_when_set():
    assert cpu_slots(range(16), NUMA2, 4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert cpu_slots(range(16), NUMA2, 2) == (tuple(range(8)), tuple(range(8, 16)))
    assert cpu_slots(range(16), NUMA2, 1) == (tuple(range(16)),)
    assert cpu_slots(range(4), None, 9) == ((0,), (1,), (2,), (3,))  # a slot is at least a core


@pytest.mark.parametrize("numa", [NUMA2, {0: [0, 1, 2], 1: list(range(3, 16))}, {0: [0, 1, 8, 9], 1: [2, 3],
                                  2: [4, 5, 6, 7, 10, 11, 12, 13, 14, 15]}])
def test_cpu_slots_never_split_a_numa_node_across_a_slot(numa):
    for slots in range(1, 18):
        groups = cpu_slots(range(16), numa, slots)
        assert sorted(c for g in groups for c in g) == list(range(16))
        assert len(groups) == min(slots, 16)
        for g in groups:
            nodes = {node_of(c, numa) for c in g}
            # within one node, or whole nodes: never part of a node along with another node's cores
            assert len(nodes) == 1 or all(set(numa[n]) <= set(g) for n in nodes), (slots, g)


def test_cpu_job_stays_on_one_numa_node_best_fit():
    m = cpu_machine("c1", range(16), NUMA2)
    assert cpu_affinity(m, (2,)) == [2]
    free = set(range(16)) - set(range(6))  # node 0 has 6 and 7 left
    assert choose(m, free, 2) == (6, 7)
    assert choose(m, free, 4) == (8, 9, 10, 11)
    assert quality(m, choose(m, free, 4)) == NODE
    assert why_not(12, [(m, free)]) == "needs 12 CPU slots on one node; the largest free set is 10, on c1"


def test_a_big_cpu_machine_places_quickly():
    numa = {0: list(range(0, 64)), 1: list(range(64, 128))}
    m = cpu_machine("c2", range(128), numa)
    started = time.perf_counter()
    free = set(range(128)) - set(range(60))
    assert choose(m, free, 4) == (60, 61, 62, 63)  # the last of node 0, keeping node 1 whole
    assert choose(m, free, 32) == tuple(range(64, 96))
    assert choose(m, set(range(128)), 1) == (0,)
    assert time.perf_counter() - started < 1.0
