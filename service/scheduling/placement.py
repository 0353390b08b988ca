"""Which devices of a machine a job gets (issue 30, "share a machine"): pure, over plain values.

One worker per machine runs several jobs at once, each on devices of its own. A job of n devices gets the n
free healthy devices with the best links between them, taken so that the devices left free stay well connected
for the next job; across machines, best fit. The worker turns its inventory (`nvidia-smi topo -m`, NVML health,
or its cores) into a Machine; the scheduler calls `place` and `why_not`; the worker pins the job with
`visible_devices` and `cpu_affinity`.
"""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from itertools import combinations
from math import comb

# choose() tries every set while sets × free devices² stays under this (every case of an 8-GPU machine: at
# most C(8,4) = 70 sets; 16 GPUs for jobs of 1, 2, 14..16); past it, a greedy search (see _grown).
SEARCH_BUDGET = 50_000


class Level(IntEnum):
    """How two devices connect, worst to best, named as in the legend of `nvidia-smi topo -m`."""

    SYS = 0  # across sockets (QPI/UPI)
    NODE = 1  # across PCIe host bridges within one NUMA node
    PHB = 2  # through a PCIe host bridge (the CPU)
    PXB = 3  # through several PCIe switches
    PIX = 4  # through at most one PCIe switch
    NV = 5  # NVLink: Link.nvlinks bonded links


@dataclass(frozen=True, order=True)
class Link:
    level: Level
    nvlinks: int = 0  # NV#: more links, more bandwidth

    @classmethod
    def parse(cls, text: str) -> "Link":
        word = text.strip().upper()
        if word.startswith("NV") and word[2:].isdigit():
            return cls(Level.NV, int(word[2:]))
        if word == "SOC":  # NOTE: drivers before R390 printed SOC for what is now SYS
            return cls(Level.SYS)
        if word not in Level.__members__:
            raise ValueError(f"unknown link {text.strip()!r} in `nvidia-smi topo -m` output")
        return cls(Level[word])

    def __str__(self) -> str:
        return f"NV{self.nvlinks}" if self.level == Level.NV else self.level.name


# NOTE: a pair the topology does not give is taken as the worst: placement never counts on a link it cannot see.
UNKNOWN = Link(Level.SYS)


@dataclass(frozen=True)
class Device:
    """A GPU, or on a CPU machine a slot: a group of cores (cpu_slots)."""

    index: int  # nvidia-smi's (PCI bus order), as in its topology; for a slot, its place in cpu_slots
    uuid: str
    memory_bytes: int | None = None
    healthy: bool = True  # the inventory's word (NVML, Xid errors): topology does not say
    numa_node: int | None = None
    reason: str | None = None  # why it is unhealthy, for why_not
    cores: tuple[int, ...] = ()  # a slot's cores


@dataclass(frozen=True)
class Machine:
    id: str
    kind: str  # cuda | cpu
    devices: tuple[Device, ...]
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)  # symmetric; a missing pair is UNKNOWN
    numa_cores: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # NUMA node -> its cores

    def link(self, a: int, b: int) -> Link:
        return self.links.get((a, b)) or self.links.get((b, a)) or UNKNOWN

    def device(self, index: int) -> Device:
        return {d.index: d for d in self.devices}[index]


@dataclass(frozen=True)
class Affinity:
    cores: tuple[int, ...]  # "CPU Affinity": the cores near the GPU
    numa_node: int | None  # "NUMA Affinity"; None where nvidia-smi says N/A (one socket)


_GPU = re.compile(r"GPU(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # NOTE: some drivers underline the header with escape codes


def _gpu_rows(text: str) -> list[tuple[int, dict[str, str], list[str]]]:
    """The matrix's GPU rows: (index, the cell under each column, the words after the matrix)."""
    lines = _ANSI.sub("", text).splitlines()
    header = next((i for i, line in enumerate(lines) if "Affinity" in line.split()), None)
    words = lines[header].split() if header is not None else []
    if "CPU" not in words:
        raise ValueError("not `nvidia-smi topo -m` output: no header with 'CPU Affinity'")
    columns = words[:words.index("CPU")]  # GPU0.. then NICs (NIC0.. or mlx5_0..)
    rows = []
    for line in lines[header + 1:]:
        cells = line.split()
        if not cells or not _GPU.fullmatch(cells[0]):
            continue  # NIC rows, blank lines, the legend
        if len(cells) <= len(columns):
            raise ValueError(f"short row in `nvidia-smi topo -m` output: {line.strip()!r}")
        rows.append((int(cells[0][3:]), dict(zip(columns, cells[1:], strict=False)), cells[len(columns) + 1:]))
    return rows


def parse_topo(text: str) -> dict[tuple[int, int], Link]:
    """The links between GPUs in `nvidia-smi topo -m` output, both orders of each pair (NICs left out)."""
    links = {}
    for gpu, cells, _ in _gpu_rows(text):
        for column, cell in cells.items():
            other = _GPU.fullmatch(column)
            if other and int(other[1]) != gpu:
                links[gpu, int(other[1])] = Link.parse(cell)
    return links


def parse_affinity(text: str) -> dict[int, Affinity]:
    """Each GPU's CPU and NUMA affinity in `nvidia-smi topo -m` output."""
    out = {}
    for gpu, _, rest in _gpu_rows(text):
        cpus, numa = (rest + ["N/A", "N/A"])[:2]
        out[gpu] = Affinity(parse_cpulist(cpus) if cpus != "N/A" else (), int(numa) if numa.isdigit() else None)
    return out


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Linux's cpulist format ("0-55,112-167"), as in topo's CPU Affinity and /sys/devices/system/node."""
    cores: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return tuple(cores)


def machine_from_topo(machine_id: str, text: str, devices: Sequence[Device]) -> Machine:
    """A GPU machine from its `nvidia-smi topo -m` output and its devices (the NUMA node filled where unset)."""
    affinity = parse_affinity(text)
    numa_cores = {a.numa_node: a.cores for a in affinity.values() if a.numa_node is not None}
    devices = tuple(replace(d, numa_node=affinity[d.index].numa_node)
                    if d.numa_node is None and d.index in affinity else d for d in devices)
    return Machine(machine_id, "cuda", devices, parse_topo(text), numa_cores)


def cpulist(cores: Sequence[int]) -> str:
    """Linux's cpulist format of a set of cores (parse_cpulist's inverse): [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def cpu_slots(cores: Sequence[int], numa: Mapping[int, Sequence[int]] | None = None,
              slots: int | None = None) -> tuple[tuple[int, ...], ...]:
    """A CPU machine's cores as slots (groups of cores), ordered by NUMA node then core.

    By default one slot per core, as a worker offers today (TRAINJOBS_WORKER_SLOTS defaults to the core count,
    a CPU job's nproc_per_node counts slots). Given `slots` (at most one per core), each NUMA node gets a share
    in proportion to its cores (at least one) and splits its cores into that many near-equal runs; with fewer
    slots than nodes, each slot takes whole nodes. So no slot holds part of a node along with another node's
    cores: a rank pinned to a slot never reaches across sockets for memory it could have locally.
    NOTE: cores are logical CPUs as numbered by the OS, so hyperthread siblings (0 and 64) may land in two slots.
    """
    every = sorted(set(cores))
    if not every or (slots is not None and slots < 1):
        raise ValueError("cpu_slots needs at least one core and one slot")
    home = {c: n for n, node_cores in (numa or {}).items() for c in node_cores}
    nodes = [[c for c in every if home.get(c) == n] for n in sorted(set(home.values()))]
    nodes = [node for node in nodes + [[c for c in every if c not in home]] if node]  # + cores of no known node
    want = len(every) if slots is None else min(slots, len(every))
    if want < len(nodes):
        return tuple(tuple(c for node in group for c in node) for group in _split(nodes, want))
    shares = [1] * len(nodes)
    for _ in range(want - len(nodes)):  # the next slot to the node with the most cores per slot
        i = max((i for i in range(len(nodes)) if shares[i] < len(nodes[i])),
                key=lambda i: (len(nodes[i]) / shares[i], -i))
        shares[i] += 1
    return tuple(tuple(run) for node, k in zip(nodes, shares, strict=True) for run in _split(node, k))


def _split(items: list, k: int) -> list[list]:
    """`items` in k contiguous runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def cpu_machine(machine_id: str, cores: Sequence[int], numa: Mapping[int, Sequence[int]] | None = None,
                slots: int | None = None) -> Machine:
    """A CPU machine whose devices are its slots: two slots on one NUMA node link at NODE, across nodes at SYS."""
    node_of = {c: n for n, node_cores in (numa or {}).items() for c in node_cores}
    devices = []
    for i, group in enumerate(cpu_slots(cores, numa, slots)):
        homes = {node_of.get(c) for c in group}
        devices.append(Device(i, f"cpu-slot-{i}", numa_node=homes.pop() if len(homes) == 1 else None, cores=group))
    near = Link(Level.NODE)  # one node: as close as cores get
    links = {(a.index, b.index): near if not numa or a.numa_node is not None and a.numa_node == b.numa_node
             else UNKNOWN for a in devices for b in devices if a.index != b.index}
    numa_cores = {n: tuple(sorted(c)) for n, c in (numa or {}).items()}
    return Machine(machine_id, "cpu", tuple(devices), links, numa_cores)


def quality(machine: Machine, devices: Sequence[int]) -> Link | None:
    """The worst link inside a set of devices (what its collectives go as fast as); None for one device."""
    return min((machine.link(a, b) for a, b in combinations(devices, 2)), default=None)


def nvlink_island(machine: Machine) -> int:
    """The size of the machine's largest set of GPUs all NVLink-connected to each other; 0 without an NVLink pair.

    What the worker labels itself with (fit.NVLINK_ISLAND_LABEL), so that the scheduler, which sees workers and
    not links, can keep small jobs off the machines whose NVLink a large job needs (pool.nvlink_preference)."""
    nv = {d.index: {e.index for e in machine.devices if e.index != d.index
                    and machine.link(d.index, e.index).level == Level.NV} for d in machine.devices}

    def largest(candidates: set[int], best: int) -> int:
        """The largest clique within `candidates` (each joined to all the caller's), if larger than `best`."""
        candidates, best = set(candidates), max(best, 0)
        while len(candidates) > best:  # a clique from here has at most len(candidates) devices
            v = candidates.pop()
            best = max(best, 1 + largest(candidates & nv[v], best - 1))
        return best

    size = largest(set(nv), 0)
    return size if size >= 2 else 0


def choose(machine: Machine, free: set[int], n: int) -> tuple[int, ...] | None:
    """The n free healthy devices to give a job, or None when fewer are free.

    In order: the set whose worst link is best (an NVLink island over a PCIe pair over a cross-socket pair);
    then the one that leaves the other free devices best connected (_left), so a later job still finds an
    NVLink or PIX pair, or a whole socket; then the lowest indices.
    """
    if n < 1:
        raise ValueError("a job needs at least one device")
    pool = sorted(d.index for d in machine.devices if d.healthy and d.index in free)
    if len(pool) < n:
        return None
    # Links as small ints (best highest), so the search compares ints rather than Links.
    levels = sorted({machine.link(a, b) for a, b in combinations(pool, 2)})
    rank = {link: i for i, link in enumerate(levels)}
    r = {(a, b): rank[machine.link(a, b)] for a in pool for b in pool if a != b}
    if comb(len(pool), n) * len(pool) ** 2 <= SEARCH_BUDGET:
        sets = list(combinations(pool, n))
    else:
        sets = _grown(r, pool, n, len(levels))
    worst = {s: min((r[p] for p in combinations(s, 2)), default=len(levels)) for s in sets}
    best = max(worst.values())
    tied = [s for s in sets if worst[s] == best]
    if len(tied) == 1:
        return tied[0]
    return max(tied, key=lambda s: (_left(r, [i for i in pool if i not in s], len(levels)), [-i for i in s]))


def _islands(r: dict[tuple[int, int], int], devices: Sequence[int], level: int) -> list[set[int]]:
    """The groups `devices` fall into when only links of `level` or better join them."""
    left, out = set(devices), []
    while left:
        island, todo = set(), [left.pop()]
        while todo:
            a = todo.pop()
            island.add(a)
            near = {b for b in left if r[a, b] >= level}
            left -= near
            todo.extend(near)
        out.append(island)
    return out


def _left(r: dict[tuple[int, int], int], rest: list[int], levels: int) -> tuple[tuple[int, ...], ...]:
    """How well the devices left free hang together: at each link level, best first, the sizes of their
    islands, largest first. Compared as tuples, this prefers keeping a pair or a socket whole over splitting
    it, and taking from the smallest island that fits (best fit inside the machine)."""
    return tuple(tuple(sorted(map(len, _islands(r, rest, level)), reverse=True))
                 for level in range(levels - 1, -1, -1))


def _grown(r: dict[tuple[int, int], int], pool: list[int], n: int, levels: int) -> list[tuple[int, ...]]:
    """The sets choose() weighs past SEARCH_BUDGET: grown greedily from seeds, each step adding the device whose
    worst link to the set is best (then the lowest index). The seeds are the lowest device of every island at
    every level, so each pair, switch and socket is tried once. On tree-shaped PCIe and all-to-all NVLink this
    finds the best worst link the exhaustive search finds; a job that must span islands may break a pair it
    would have kept. Work: seeds × n × free devices, plus the islands (levels × free²)."""
    seeds = {pool[0]} | {min(island) for level in range(levels) for island in _islands(r, pool, level)}
    out = set()
    for seed in sorted(seeds):
        chosen = [seed]
        near = {i: r[seed, i] for i in pool if i != seed}  # each device's worst link to the set so far
        while len(chosen) < n:
            pick = max(near, key=lambda i: (near[i], -i))
            chosen.append(pick)
            del near[pick]
            for i in near:
                near[i] = min(near[i], r[pick, i])
        out.add(tuple(sorted(chosen)))
    return sorted(out)


def _healthy_free(machine: Machine, free: set[int]) -> set[int]:
    return {d.index for d in machine.devices if d.healthy and d.index in free}


def place(n: int, machines: Sequence[tuple[Machine, set[int]]]) -> tuple[str, tuple[int, ...]] | None:
    """Where a job of n devices on one machine goes: (machine id, devices), or None when none has n free.

    Best fit, as policy.plan assigns workers: first the machines whose best set is as good as the machine could
    give with every device free (fragmentation costs the job no bandwidth there); among them the one left with
    the fewest free devices (whole machines stay free for big jobs), then the better worst link, then the id.
    """
    best: tuple | None = None
    for machine, free in machines:
        chosen = choose(machine, free, n)
        if chosen is None:
            continue
        got = quality(machine, chosen)
        could = quality(machine, choose(machine, {d.index for d in machine.devices}, n) or ())
        strength = (-got.level, -got.nvlinks) if got else (0, 0)
        key = (got is not None and could is not None and got < could,
               len(_healthy_free(machine, free)) - n, strength, machine.id)
        if best is None or key < best[0]:
            best = (key, machine.id, chosen)
    return (best[1], best[2]) if best else None


def why_not(n: int, machines: Sequence[tuple[Machine, set[int]]]) -> str | None:
    """Why a job of n devices on one machine cannot be placed now, in device terms; None when it can.

    `free` is every device no job holds, unhealthy ones included: they are named where they are the reason
    (the machine would have n free without them)."""
    if place(n, machines) is not None:
        return None
    noun = "CPU slots" if machines and all(m.kind == "cpu" for m, _ in machines) else "GPUs"
    head = f"needs {n} {noun} on one node"
    if not machines:
        return f"{head}; no machine"
    machine, free = max(sorted(machines, key=lambda mf: mf[0].id), key=lambda mf: len(_healthy_free(*mf)))
    parts = [head, f"the largest free set is {len(_healthy_free(machine, free))}, on {machine.id}"]
    if all(len(m.devices) < n for m, _ in machines):
        parts.append(f"no node has {n}")
    sick = []
    for m, free in machines:
        unhealthy = [d for d in m.devices if not d.healthy and d.index in free]
        if len(_healthy_free(m, free)) + len(unhealthy) >= n:
            label = "GPU" if m.kind == "cuda" else "slot"
            sick += [f"{m.id} {label}{d.index} ({d.reason or 'no reason given'})" for d in unhealthy]
    if sick:
        parts.append("unhealthy: " + ", ".join(sick))
    return "; ".join(parts)


def cpu_affinity(machine: Machine, devices: Sequence[int]) -> list[int]:
    """The cores to pin a job's ranks to: a GPU job's, those of its GPUs' NUMA nodes (memory and PCIe traffic
    stay on the GPUs' socket); a CPU job's, its slots'. [] when a GPU's node is unknown: do not pin."""
    chosen = [machine.device(i) for i in devices]
    if machine.kind == "cpu":
        return sorted({c for d in chosen for c in d.cores})
    if any(d.numa_node not in machine.numa_cores for d in chosen):
        return []
    return sorted({c for d in chosen for c in machine.numa_cores[d.numa_node]})


def visible_devices(machine: Machine, devices: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a job, by UUID in the chosen order ("" hides every GPU from a CPU job).

    NOTE: UUIDs, not indices: topo and NVML number GPUs in PCI bus order but CUDA by default fastest first
    (CUDA_DEVICE_ORDER), so an index can name another job's GPU; a UUID names the same one everywhere."""
    if machine.kind != "cuda":
        return ""
    return ",".join(machine.device(i).uuid for i in devices)
