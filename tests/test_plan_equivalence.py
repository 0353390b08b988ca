"""The plan's indexes (service/scheduling/room.py, waiting.py) decide exactly what its walks over every fitting
worker decided: on random pools, every job's place, workers, pending reason and estimate, the reservations, the
devices kept and the preemptions equal those of the walks kept in tests/plan_reference.py.

The pools mix what the plan reads: shared workers (with and without known devices) and workers of one job at a
time, GPUs and CPU slots, NVLink islands, selectors and memory; gangs old enough to reserve and gangs forming;
priorities, backoffs, quotas, preemptible jobs past their minimum runtime; fair share and FIFO.
"""

import random
from dataclasses import asdict

import pytest

from service.scheduling import policy
from service.scheduling.placement import Device, Level, Link, Machine
from service.scheduling.policy import Account, Node, Running, Settings, Snapshot, Team, Waiting
from service.workers.fit import NVLINK_ISLAND_LABEL, Need
from tests import plan_reference

NOW = 100_000.0
GIB = 2**30
OWNERS = ["ann", "bob", "cai", "dee", "eve", "fay"]


def machine(worker: str, kind: str, slots: int) -> Machine:
    """Two halves joined across sockets: NVLink within a half on a GPU machine, one NUMA node on a CPU one."""
    near = Link(Level.NV, 4) if kind == "cuda" else Link(Level.NODE)
    devices = tuple(Device(i, f"{worker}-{i}", numa_node=int(i >= slots // 2)) for i in range(slots))
    return Machine(worker, kind, devices, {(a, b): near if (a < slots // 2) == (b < slots // 2) else Link(Level.SYS)
                                           for a in range(slots) for b in range(slots) if a != b})


def need(rng: random.Random, *, gang: bool) -> Need:
    device = rng.choice(["cuda", "cuda", "cuda", "cpu", "auto"])
    labels = {"zone": rng.choice("ab")} if rng.random() < 0.15 else {}
    memory = rng.choice([None, None, 20 * GIB, 60 * GIB])
    return Need(device, rng.choice([1, 1, 2, 4, 8]), memory, "cuda" if memory else None, labels,
                nodes=rng.choice([2, 2, 3]) if gang else 1)


def pool(seed: int, workers: tuple[int, int] = (2, 40), queued: tuple[int, int] = (0, 120)) -> Snapshot:
    """A random pool of `workers` and `queued` jobs waiting (each a range), the same for the same seed."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    running: list[Running] = []
    for i in range(rng.randint(*workers)):
        wid = f"w{rng.randint(0, 999):03d}-{i}"
        kind = rng.choice(["cuda", "cuda", "cuda", "cpu"])
        slots = rng.choice([1, 2, 4, 8, 8]) if kind == "cuda" else rng.choice([4, 8])
        labels = {"zone": rng.choice("ab")}
        if kind == "cuda" and slots > 1 and rng.random() < 0.6:
            labels[NVLINK_ISLAND_LABEL] = str(rng.choice([slots, slots // 2]))
        memory = rng.choice([None, 40 * GIB, 80 * GIB]) if kind == "cuda" else None
        jobs: dict[str, frozenset[int]] = {}
        left = list(range(slots))
        rng.shuffle(left)
        shared = slots > 1 and rng.random() < 0.6
        while left and rng.random() < 0.7:
            take = min(len(left), rng.choice([1, 2, 4]) if shared else slots)
            jid = f"r{len(running)}"
            jobs[jid], left = frozenset(left[:take]), left[take:]
            started = NOW - rng.uniform(0, 4000)
            running.append(Running(jid, rng.choice(OWNERS), rng.choice(["low", "normal", "high"]), take, 1, started,
                                   rng.choice([600.0, 3600.0, 7200.0]), (wid,),
                                   eta_s=rng.choice([None, rng.uniform(10, 3000)]),
                                   preemptible=rng.random() < 0.8, preempt_requested=rng.random() < 0.1))
            if not shared:
                break
        if shared:
            room = max(0, len(left) - (rng.random() < 0.1))  # now and then a device held by a claim not shown
            known = rng.random() < 0.8
            nodes.append(Node(wid, kind, slots, memory, labels, running=min(jobs) if jobs else None, room=room,
                              machine=machine(wid, kind, slots) if known else None,
                              free_devices=frozenset(left) if known else None, held=jobs if known else {}))
        else:
            nodes.append(Node(wid, kind, slots, memory, labels, running=next(iter(jobs), None)))
    for g in range(rng.randint(0, 2)):  # gangs forming: node 0 on a worker, the rest to join
        host = rng.choice(nodes)
        running.append(Running(f"f{g}", rng.choice(OWNERS), "normal", 1, rng.choice([2, 3]), NOW - 50, 3600.0,
                               (host.id,), need=Need(host.device, 1, None, None, nodes=2)))
    waiting = []
    for j in range(rng.randint(*queued)):
        priority = rng.choice(["low", "normal", "normal", "high"])
        submitted = NOW - rng.uniform(0, 3000)
        waiting.append(Waiting(f"q{j}", rng.choice(OWNERS), priority,
                               priority if rng.random() < 0.8 else "high", submitted, submitted + rng.uniform(0, 100),
                               need(rng, gang=rng.random() < 0.15), rng.choice([300.0, 1800.0, 3600.0, 86400.0]),
                               NOW + 60 if rng.random() < 0.05 else None))
    accounts = {o: Account(team=rng.choice([None, "red", "blue"]), weight=rng.choice([1.0, 2.0]),
                           max_slots=rng.choice([None, None, None, 8, 16])) for o in OWNERS}
    teams = {"red": Team(2.0, rng.choice([None, 24])), "blue": Team(1.0, None)}
    settings = Settings(policy=rng.choice(["fair", "fair", "fifo"]), preempt_after_s=rng.choice([60.0, 1e9]),
                        min_runtime_s=rng.choice([0.0, 600.0]), reserve_after_s=rng.choice([0.0, 300.0, 1e9]),
                        max_reservations=rng.choice([1, 2]), nvlink_whole_jobs=rng.random() < 0.8)
    usage = {o: rng.uniform(0, 1e6) for o in OWNERS if rng.random() < 0.8}
    return Snapshot(NOW, waiting, running, nodes, usage, accounts, teams, settings)


@pytest.mark.parametrize("seed", range(300))
def test_the_plan_decides_as_its_walks_did_on_a_random_pool(seed):
    snap = pool(seed)
    assert asdict(policy.plan(snap)) == asdict(plan_reference.plan(snap))


@pytest.mark.parametrize("seed", range(1000, 1006))
def test_the_plan_decides_as_its_walks_did_on_a_large_random_pool(seed):
    """Hundreds of workers and jobs: long heaps, many stale entries, jobs placed between jobs that wait."""
    snap = pool(seed, workers=(150, 300), queued=(300, 600))
    assert asdict(policy.plan(snap)) == asdict(plan_reference.plan(snap))


def test_the_random_pools_reach_every_kind_of_decision():
    """The pools above are worth comparing on: between them they start jobs, reserve, preempt, keep devices, and
    give every kind of pending reason."""
    plans = [policy.plan(pool(seed)) for seed in range(300)]
    reasons = [p.reason or "" for result in plans for p in result.order]
    assert sum(1 for result in plans for p in result.order if p.workers) > 1000
    assert sum(len(result.preemptions) for result in plans) > 20
    assert sum(len(result.reservations) for result in plans) > 20
    assert sum(1 for result in plans if result.kept) > 10
    for kind in ("waiting for a free worker", "on one node; the largest free set", "on one NVLink island",
                 "reserved, ", "behind ", "over user quota", "over team quota", "retry backoff", "needs 2 nodes; "):
        assert any(kind in r for r in reasons), kind
    assert sum(1 for result in plans for p in result.order if p.estimated_start not in (None, NOW)) > 500
