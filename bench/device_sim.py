"""A simulated month of 40 machines × 8 GPUs (issue 30, "share a machine"): where jobs go, four ways, same trace.

Pure Python, seeded, no torch and no database: a discrete-event simulation (arrivals and ends) of one trace under
each policy. Every policy is FIFO in arrival order with backfill: at each instant the waiting jobs are tried
oldest first and any that fits starts, whether or not older ones could. They differ only in what a job holds:

1. "one job per worker" (today): one 8-slot worker per machine runs one job at a time, whatever its size, so a
   1-GPU job holds all 8 GPUs; a job uses the lowest-indexed GPUs of its machine (torchrun's ranks 0..k-1 on
   CUDA_VISIBLE_DEVICES); a multi-node job takes n free machines. Workers as policy.plan picks them: lowest id.
2. "one worker per GPU" (today's workaround): 320 one-slot workers; a k-GPU job is a gang of k workers, picked
   as policy.plan picks them (sorted by id: m00-g0, m00-g1, ...), with no notion of which share a machine.
3. "device-level first-fit": one worker per machine runs several jobs; a job takes the k lowest-indexed free
   GPUs of the first machine (by id) with k free.
4. "best-fit with topology", as production places a job: policy.plan picks the worker (best fit: the fewest
   free GPUs left; on a tie, service.scheduling.pool.nvlink_preference over the NVLink island each worker labels
   itself with, so a small job leaves an NVLink machine whole; then the id), and the worker takes
   placement.choose's best-linked set on it. A one-node job that fills an island (8 GPUs) takes only NVLink
   machines while any is live (pool.island_floor, TRAINJOBS_NVLINK_WHOLE_JOBS); a gang only prefers them. The
   simulator calls the production rules, not copies of them.
4o. (in the defaults) policy 4 with that setting off: NVLink only orders the machines (production before it).
4-. (only with --policies best-fit-plain) policy 4 before nvlink_preference: placement.place across machines.
4R. policy 4, plus a reservation (--reserve-after): once the oldest job of >= 8 GPUs has waited that long, the
   machines it will get (the most free GPUs, among those island_floor lets it take) take no new job until it
   starts: the standard remedy for backfill starving jobs that need a whole machine (EASY without runtimes).
4P. (only with --policies) 4-, but a job of < 8 GPUs goes to a PCIe machine that gives it its best link.

In 3, 4, 4o, 4- and 4R a multi-node job (n nodes × 8 GPUs) needs n whole free machines (best fit: NVLink ones first).

The fleet: `mixed` (default) alternates an 8-GPU NVLink node (tests/fixtures/topo/dgx_h100_nvlink_8gpu.txt:
every pair NV18) and a dual-socket PCIe node (pcie_4x4_dual_socket.txt: PIX pairs, NODE within a socket, SYS
across), m00 NVLink, m01 PCIe, ...; `nvlink`: all 40 NVLink. Built with placement.machine_from_topo.

The trace, shaped like Microsoft Philly (Jeon et al., ATC'19) and SenseTime Helios (Hu et al., SC'21): mostly
1-GPU jobs, some 2/4/8-GPU jobs, a few of 2-4 nodes × 8 GPUs; log-normal runtimes (median tens of minutes, a
tail of many hours, clipped to [1 min, 3 days]), longer for larger jobs. 20 users with Zipf-skewed submission
rates (the busiest submits ~28% of the jobs), each with its own taste for large jobs (its weights for jobs of 4+
GPUs × a factor from 1/3 to 3). Jobs are drawn until their GPU-hours reach `load` × the fleet's GPU-hours in
the period, then given Poisson arrival times over it (uniform order statistics: a Poisson process conditioned on
its count), so the offered load is exactly `load`. No diurnal cycle, no failures, no priorities, no preemption.

Measured over the period [0, T] (jobs are all submitted in it; the simulation runs on with no arrivals until
every job has started, so every wait is measured, none censored):
  - utilisation: GPU-hours jobs used in [0, T] ÷ the GPU-hours offered in [0, T] (what the jobs would have run in
    [0, T] had none waited: the work still running at T, or never reached, is no scheduler's loss; over a month
    it is ~5% of the trace's work, over a 3-day --days run a quarter), and ÷ capacity. `of trace` divides by all
    the trace's work instead. In policy 1 a job uses its k GPUs; the 8-k more it holds idle count in `held`.
  - waits of 1-GPU jobs (median, p95), the longest wait of a job of >= 8 GPUs, the p95 of 8-GPU jobs' waits.
  - locality: 8-GPU jobs on one NVLink island (all 8 on one NVLink machine) and on one machine; 2- and 4-GPU jobs
    whose worst internal link is the best that machine kind offers for that size (NV on NVLink nodes; a PIX pair
    for 2 and one socket, NODE, for 4 on PCIe nodes), and 2- and 4-GPU jobs on an NVLink node (what the NVLink
    rule of policy 4 gives up for the 8-GPU jobs). A gang across machines is none of these.
  - fairness: Jain's index over users of x_u = GPU-hours received in [0, T] ÷ GPU-hours offered in [0, T] (as
    above, per user: 1.0 for everyone when no job waits); also, for context, Jain over each user's mean bounded
    slowdown ((wait + run) ÷ max(run, 10 min)), which one long wait of a short job moves a lot.
"""

import argparse
import heapq
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.scheduling import placement  # noqa: E402
from service.scheduling.placement import Device, Machine, machine_from_topo, nvlink_island, quality  # noqa: E402
from service.scheduling.pool import island_floor, nvlink_preference  # noqa: E402

HOUR = 3600.0
DAY = 24 * HOUR
GPUS = 8
MACHINES = 40
TOPO = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "topo"
# GPUs per job: (share of jobs, median runtime in minutes, log-normal sigma). Larger jobs run longer (Helios).
SIZES = {
    1: (0.730, 20, 1.8),
    2: (0.100, 30, 1.8),
    4: (0.080, 45, 1.9),
    8: (0.075, 60, 2.0),
    16: (0.007, 120, 2.0),
    24: (0.004, 120, 2.0),
    32: (0.004, 120, 2.0),
}
MIN_RUN_S, MAX_RUN_S = 60.0, 3 * DAY
USERS = 20
SLOWDOWN_FLOOR_S = 600.0
POLICIES = {
    "whole": "1 one job per worker (today)",
    "per-gpu": "2 one worker per GPU",
    "first-fit": "3 device-level first-fit",
    "best-fit": "4 best-fit with topology",
    "best-fit-order": "4o best-fit, NVLink only orders",  # policy 4 with TRAINJOBS_NVLINK_WHOLE_JOBS=false
    "best-fit-plain": "4- best-fit, no NVLink rule",  # not run by default: the policy 4 before the rule
    "best-fit+res": "4R best-fit + reservation",
    "best-fit+pcie": "4P best-fit, small jobs PCIe first",  # not run by default: see --policies
}
DEFAULT_POLICIES = ("whole", "per-gpu", "first-fit", "best-fit-order", "best-fit", "best-fit+res")
DEVICE_LEVEL = ("first-fit", "best-fit-order", "best-fit", "best-fit-plain", "best-fit+res", "best-fit+pcie")
WHOLE_ISLANDS = ("best-fit", "best-fit+res")  # the policies production's island rule (island_floor) binds


@dataclass(frozen=True)
class Job:
    id: int
    user: int
    gpus: int
    run_s: float
    submit: float

    @property
    def nodes(self) -> int:
        """Machines a multi-node job spans (1 for a job of up to 8 GPUs)."""
        return max(1, self.gpus // GPUS)


def trace(seed: int, load: float, days: float) -> list[Job]:
    """Jobs whose GPU-hours are `load` × the fleet's over `days`, with Poisson arrivals (see the docstring)."""
    rng = random.Random(seed)
    period = days * DAY
    rate = [1 / (u + 1) for u in range(USERS)]  # Zipf, s = 1
    sizes = list(SIZES)
    mixes = []
    for _ in range(USERS):
        tilt = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))
        mixes.append([SIZES[s][0] * (tilt if s >= 4 else 1.0) for s in sizes])
    want, work, drawn = load * MACHINES * GPUS * period, 0.0, []
    while work < want:
        user = rng.choices(range(USERS), rate)[0]
        gpus = rng.choices(sizes, mixes[user])[0]
        _, median_min, sigma = SIZES[gpus]
        run_s = min(max(rng.lognormvariate(math.log(median_min * 60), sigma), MIN_RUN_S), MAX_RUN_S)
        drawn.append((user, gpus, run_s))
        work += gpus * run_s
    times = sorted(rng.uniform(0, period) for _ in drawn)
    return [Job(i, u, g, r, t) for i, ((u, g, r), t) in enumerate(zip(drawn, times, strict=True))]


def fleet(kind: str) -> tuple[list[Machine], dict[str, bool]]:
    """The 40 machines, and which are NVLink nodes. Machines of one kind share one parsed topology (same links
    object), which is what lets _memoize_choose key on it."""
    devices = [Device(i, f"GPU-{i}") for i in range(GPUS)]
    nv = machine_from_topo("nv", (TOPO / "dgx_h100_nvlink_8gpu.txt").read_text(), devices)
    pcie = machine_from_topo("pcie", (TOPO / "pcie_4x4_dual_socket.txt").read_text(), devices)
    machines = [replace(nv if kind == "nvlink" or i % 2 == 0 else pcie, id=f"m{i:02d}") for i in range(MACHINES)]
    return machines, {m.id: m.links is nv.links for m in machines}


def _memoize_choose() -> None:
    """placement.choose is pure and, on an 8-GPU machine, ~0.1 ms; place() calls it twice per machine, so a month
    of best fit would take minutes. The answer depends only on the topology, the free set and n: cache it (same
    answers). place() looks choose up in the module when called, so it gets the cached one (in this process)."""
    original = placement.choose
    if getattr(original, "memoized", False):
        return
    cache: dict[tuple, tuple[int, ...] | None] = {}

    def choose(machine: Machine, free: set[int], n: int) -> tuple[int, ...] | None:
        key = (id(machine.links), frozenset(free), n)
        if key not in cache:
            cache[key] = original(machine, free, n)
        return cache[key]

    choose.memoized = True
    placement.choose = choose


class Sim:
    """One policy over one trace. The waiting jobs sit in one FIFO per size: a pass tries the oldest head; when a
    size cannot start, no larger one can (what fits a job fits a smaller one, but the island rule may keep an 8-GPU
    job off machines a gang may take: then only its size waits), so a pass costs its starts and a failure a size."""

    def __init__(self, jobs: list[Job], policy: str, machines: list[Machine], nvlink: dict[str, bool],
                 reserve_after_s: float) -> None:
        self.jobs, self.policy, self.machines, self.nvlink = jobs, policy, machines, nvlink
        self.reserve_after_s = reserve_after_s if policy == "best-fit+res" else math.inf
        self.free = [set(range(GPUS)) for _ in machines]
        self.queues: dict[int, deque[Job]] = {s: deque() for s in SIZES}
        self.start: dict[int, float] = {}
        self.held: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # job -> (machine, GPUs taken) it holds
        self.local: dict[int, tuple[bool, bool, bool]] = {}  # job -> (one machine, on NVLink, best link)
        self.reserved: list[int] = []  # machines held for self.holder
        self.holder: Job | None = None
        self.ends: list[tuple[float, int]] = []
        self.wakes: list[float] = []
        self.taken: dict[int, int] = {}  # job -> GPUs it took from the pool (policy 1: 8 per machine)
        self.index = {m.id: i for i, m in enumerate(machines)}
        self.island = [nvlink_island(m) for m in machines]  # what each machine's worker labels itself with
        self.floors: dict[tuple[int, int], frozenset[int]] = {}  # (GPUs a node, nodes) -> machines it may not take
        # The best worst link each kind of machine offers a job of k GPUs (all GPUs free; None for one GPU).
        self.best = {(self.nvlink[m.id], k): quality(m, placement.choose(m, set(range(GPUS)), k))
                     for m in machines for k in range(1, GPUS + 1)}

    # --- what each policy gives a job: [(machine index, GPUs)] or None ---

    def _whole_free(self, exclude: set[int], n: int, nvlink_first: bool) -> list[int] | None:
        whole = [i for i, f in enumerate(self.free) if len(f) == GPUS and i not in exclude]
        if nvlink_first:
            whole.sort(key=lambda i: (not self.nvlink[self.machines[i].id], i))
        return whole[:n] if len(whole) >= n else None

    def fit(self, job: Job, exclude: set[int]) -> list[tuple[int, tuple[int, ...]]] | None:
        k, policy = job.gpus, self.policy
        exclude = exclude | self._no_island(job)
        if policy == "whole":
            got = self._whole_free(exclude, job.nodes, nvlink_first=False)
            return [(i, tuple(range(GPUS))) for i in got] if got else None
        if policy == "per-gpu":
            pool = [(i, g) for i, f in enumerate(self.free) for g in sorted(f)]
            if len(pool) < k:
                return None
            out: dict[int, list[int]] = {}
            for i, g in pool[:k]:
                out.setdefault(i, []).append(g)
            return [(i, tuple(gs)) for i, gs in out.items()]
        if job.nodes > 1 or k == GPUS:
            got = self._whole_free(exclude, job.nodes, nvlink_first=policy != "first-fit")
            return [(i, tuple(range(GPUS))) for i in got] if got else None
        if policy == "first-fit":
            for i, f in enumerate(self.free):
                if len(f) >= k and i not in exclude:
                    return [(i, tuple(sorted(f)[:k]))]
            return None
        if policy in ("best-fit", "best-fit-order", "best-fit+res"):
            return self._ranked_fit(k, exclude)
        if policy == "best-fit+pcie":  # 4P: a PCIe machine that gives the job its best link, else as 4-
            got = self._best_fit(k, exclude, only_pcie=True)
            if got and quality(self.machines[got[0][0]], got[0][1]) == self.best.get((False, k)):
                return got
        return self._best_fit(k, exclude)

    def _no_island(self, job: Job) -> frozenset[int]:
        """The machines production's island rule keeps the job off (here every machine fits, and all are live)."""
        key = (min(job.gpus, GPUS), job.nodes)
        if key not in self.floors:
            floor = island_floor(*key, self.island) if self.policy in WHOLE_ISLANDS else 0
            self.floors[key] = frozenset(i for i, island in enumerate(self.island) if island < floor)
        return self.floors[key]

    def _ranked_fit(self, k: int, exclude: set[int]) -> list[tuple[int, tuple[int, ...]]] | None:
        """Policy 4: the machine policy.plan assigns (its sort key: the free GPUs left, nvlink_preference, the
        slots, all 8 here, and the id, whose order is the index's), then the set the worker's placement.choose
        takes on it."""
        fits = [i for i, f in enumerate(self.free) if len(f) >= k and i not in exclude]
        if not fits:
            return None
        i = min(fits, key=lambda i: (len(self.free[i]) - k, nvlink_preference(k, self.island[i]), i))
        return [(i, placement.choose(self.machines[i], self.free[i], k))]

    def _best_fit(self, k: int, exclude: set[int], only_pcie: bool = False) -> list[tuple[int, tuple[int, ...]]]:
        """placement.place over the machines with k free, one per distinct (topology, free set): the others would
        tie with it on every key but the id, and the lowest id wins ties (exact, and 5-10× faster)."""
        seen, candidates = set(), []
        for i, f in enumerate(self.free):
            key = (id(self.machines[i].links), frozenset(f))
            skip = i in exclude or key in seen or (only_pcie and self.nvlink[self.machines[i].id])
            if len(f) >= k and not skip:
                seen.add(key)
                candidates.append((self.machines[i], f))
        placed = placement.place(k, candidates) if candidates else None
        return [(self.index[placed[0]], placed[1])] if placed else None

    # --- the event loop ---

    def run(self) -> None:
        arrivals = deque(self.jobs)
        while arrivals or self.ends or any(self.queues.values()):
            t = min(arrivals[0].submit if arrivals else math.inf, self.ends[0][0] if self.ends else math.inf,
                    self.wakes[0] if self.wakes else math.inf)
            if t == math.inf:
                raise RuntimeError(f"{self.policy}: jobs wait with nothing running (a job that never fits?)")
            while arrivals and arrivals[0].submit == t:
                job = arrivals.popleft()
                self.queues[job.gpus].append(job)
                if job.gpus >= GPUS and self.reserve_after_s < math.inf:
                    heapq.heappush(self.wakes, t + self.reserve_after_s)
            while self.ends and self.ends[0][0] == t:
                _, job_id = heapq.heappop(self.ends)
                for i, gs in self.held.pop(job_id):
                    self.free[i].update(gs)
            while self.wakes and self.wakes[0] <= t:
                heapq.heappop(self.wakes)
            if not arrivals and not any(self.queues.values()):
                break  # every job has started; what runs on is accounted for from the starts
            self.schedule(t)

    def schedule(self, now: float) -> None:
        exclude: set[int] = set()
        if self.reserve_after_s < math.inf:
            exclude = self._reserve(now)
        blocked: set[int] = set()  # sizes that cannot start in this pass
        while True:  # the holder of a reservation, if any, could not start: nor can a job of its size elsewhere
            heads = [q[0] for s, q in self.queues.items() if q and s not in blocked and q[0] is not self.holder]
            if not heads:
                return
            job = min(heads, key=lambda j: j.submit)
            got = self.fit(job, exclude)
            if got is None:  # no larger size fits either, unless the island rule kept this one off some machines
                blocked.update([job.gpus] if self._no_island(job) else [s for s in SIZES if s >= job.gpus])
                continue
            self._start(job, got, now)

    def _reserve(self, now: float) -> set[int]:
        """The machines to keep from other jobs (see 4R): the oldest job of >= 8 GPUs, once it has waited
        reserve_after_s, starts first when it fits; else the machines with the most free GPUs (the ones it holds
        already on a tie, then NVLink, then id) are kept for it."""
        large = [q[0] for s, q in self.queues.items() if s >= GPUS and q]
        oldest = min(large, key=lambda j: j.submit, default=None)
        if oldest is None or now - oldest.submit < self.reserve_after_s:
            self.holder, self.reserved = None, []
            return set()
        got = self.fit(oldest, set())
        if got is not None:
            self._start(oldest, got, now)
            self.holder, self.reserved = None, []
            return self._reserve(now)  # the next oldest may be past the bound too
        held = set(self.reserved) if self.holder is oldest else set()
        order = sorted(set(range(len(self.machines))) - self._no_island(oldest),
                       key=lambda i: (-len(self.free[i]), i not in held, not self.nvlink[self.machines[i].id], i))
        self.holder, self.reserved = oldest, order[:oldest.nodes]
        return set(self.reserved)

    def _start(self, job: Job, got: list[tuple[int, tuple[int, ...]]], now: float) -> None:
        queue = self.queues[job.gpus]
        assert queue[0] is job
        queue.popleft()
        for i, gs in got:
            assert set(gs) <= self.free[i], (self.policy, job, got)
            self.free[i].difference_update(gs)
        self.held[job.id] = got
        self.taken[job.id] = sum(len(gs) for _, gs in got)
        self.start[job.id] = now
        heapq.heappush(self.ends, (now + job.run_s, job.id))
        if job.nodes == 1:
            one = len(got) == 1
            i, gs = got[0]
            used = gs[:job.gpus]  # policy 1: the job's ranks use the lowest GPUs it holds
            on_nv = one and self.nvlink[self.machines[i].id]
            best = one and job.gpus in (2, 4) and quality(self.machines[i], used) == self.best[on_nv, job.gpus]
            self.local[job.id] = (one, on_nv, best)


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 1.0


def report(sim: Sim, jobs: list[Job], period: float, wall: float) -> dict:
    cap = MACHINES * GPUS * period
    offered = sum(j.gpus * j.run_s for j in jobs)

    def within(j: Job, start: float) -> float:
        return j.gpus * max(0.0, min(start + j.run_s, period) - min(start, period))

    used = ideal = held = 0.0
    got: dict[int, float] = {}
    asked: dict[int, float] = {}
    slow: dict[int, list[float]] = {}
    for j in jobs:
        s = sim.start[j.id]
        used += within(j, s)
        held += within(j, s) * sim.taken[j.id] / j.gpus
        ideal += within(j, j.submit)
        got[j.user] = got.get(j.user, 0.0) + within(j, s)
        asked[j.user] = asked.get(j.user, 0.0) + within(j, j.submit)
        slow.setdefault(j.user, []).append((s - j.submit + j.run_s) / max(j.run_s, SLOWDOWN_FLOOR_S))
    wait = {j.id: sim.start[j.id] - j.submit for j in jobs}
    ones = [wait[j.id] for j in jobs if j.gpus == 1]
    eights = [j for j in jobs if j.gpus == GPUS]
    pairs = [j for j in jobs if j.gpus in (2, 4)]
    return {
        "used": used / ideal, "used_cap": used / cap, "used_trace": used / offered, "ideal": ideal / offered,
        "held_cap": held / cap,
        "p50": pct(ones, 0.5), "p95": pct(ones, 0.95),
        "large_max": max((wait[j.id] for j in jobs if j.gpus >= GPUS), default=0.0),
        "eight_p95": pct([wait[j.id] for j in eights], 0.95),
        "nvlink8": sum(sim.local[j.id][1] for j in eights) / max(len(eights), 1),
        "one8": sum(sim.local[j.id][0] for j in eights) / max(len(eights), 1),
        "best24": sum(sim.local[j.id][2] for j in pairs) / max(len(pairs), 1),
        "nv24": sum(sim.local[j.id][1] for j in pairs) / max(len(pairs), 1),
        "jain": jain([got[u] / asked[u] for u in asked]),
        "jain_slow": jain([sum(v) / len(v) for v in slow.values()]),
        "queued_at_T": sum(1 for j in jobs if sim.start[j.id] > period),
        "wall": wall,
    }


def fmt_t(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s >= DAY:
        return f"{s / DAY:.1f} d"
    if s >= HOUR:
        return f"{s / HOUR:.1f} h"
    if s >= 60:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"


def table(rows: list[tuple[str, dict]]) -> str:
    head = ["policy", "used/offered", "used/cap", "of trace", "held/cap", "1-GPU wait p50", "p95", "max wait >=8 GPU",
            "8-GPU p95", "8-GPU on NVLink", "8-GPU 1 machine", "2/4 best link", "2/4 on NVLink", "Jain recv/dem",
            "Jain slowdown", "waiting at T", "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows:
        cells = [POLICIES[name], f"{r['used']:.1%}", f"{r['used_cap']:.1%}", f"{r['used_trace']:.1%}",
                 f"{r['held_cap']:.1%}",
                 fmt_t(r["p50"]), fmt_t(r["p95"]), fmt_t(r["large_max"]), fmt_t(r["eight_p95"]),
                 f"{r['nvlink8']:.0%}", f"{r['one8']:.0%}", f"{r['best24']:.0%}", f"{r['nv24']:.0%}",
                 f"{r['jain']:.3f}", f"{r['jain_slow']:.3f}", str(r["queued_at_T"]), f"{r['wall']:.0f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(name: str, r: dict, today: dict, load: float, workaround: dict | None) -> str:
    """The issue's goals for the device-level policy, each met or not (today = policy 1; the longest large wait
    also against policy 2, the workaround, which is the stricter baseline)."""
    checks = [
        (f"used >= 90% of offered{'' if load <= 0.8 else ' (goal set at load 0.8)'}", r["used"] >= 0.9,
         f"{r['used']:.1%}"),
        ("1-GPU median wait <= 1/10 of today's", r["p50"] <= today["p50"] / 10,
         f"{fmt_t(r['p50'])} vs {fmt_t(today['p50'])} / 10"),
        ("every 8-GPU job on one NVLink island", r["nvlink8"] >= 1.0, f"{r['nvlink8']:.1%}"),
        ("longest wait of a >=8-GPU job <= today's", r["large_max"] <= today["large_max"],
         f"{fmt_t(r['large_max'])} vs {fmt_t(today['large_max'])}"
         + (f"; vs the workaround's {fmt_t(workaround['large_max'])}: "
            f"{'no worse' if r['large_max'] <= workaround['large_max'] else 'worse'}" if workaround else "")),
        ("Jain >= 0.95", r["jain"] >= 0.95, f"{r['jain']:.3f}"),
    ]
    return f"  {POLICIES[name]}: " + "; ".join(f"{what}: {'met' if ok else 'NOT met'} ({why})"
                                                for what, ok, why in checks)


def describe(jobs: list[Job], period: float) -> str:
    counts = {s: sum(1 for j in jobs if j.gpus == s) for s in SIZES}
    hours = {s: sum(j.gpus * j.run_s for j in jobs if j.gpus == s) for s in SIZES}
    total_h = sum(hours.values())
    runs = sorted(j.run_s for j in jobs)
    per_user = sorted((sum(1 for j in jobs if j.user == u) for u in range(USERS)), reverse=True)
    machine_load = sum(j.nodes * j.run_s for j in jobs) / (MACHINES * period)
    return (f"{len(jobs)} jobs; by GPUs (share of jobs / of GPU-hours): "
            + ", ".join(f"{s}: {counts[s] / len(jobs):.1%} / {hours[s] / total_h:.0%}" for s in SIZES)
            + f"\n  runtime median {fmt_t(pct(runs, 0.5))}, p90 {fmt_t(pct(runs, 0.9))}, p99 {fmt_t(pct(runs, 0.99))}"
            f", mean {fmt_t(sum(runs) / len(runs))}; offered {total_h / (MACHINES * GPUS * period):.2f} of the "
            f"GPU-hours, {machine_load:.2f} of the machine-hours (what policy 1 needs: one job per machine)"
            f"\n  jobs per user: busiest {per_user[0] / len(jobs):.0%}, median {per_user[USERS // 2]}, "
            f"least {per_user[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--loads", default="0.8,1.1", help="offered loads, comma-separated")
    parser.add_argument("--fleet", choices=("mixed", "nvlink"), default="mixed")
    parser.add_argument("--reserve-after", type=float, default=6.0, help="hours (policy 4R)")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated, of: " + ", ".join(POLICIES))
    args = parser.parse_args()
    _memoize_choose()
    machines, nvlink = fleet(args.fleet)
    period = args.days * DAY
    names = args.policies.split(",")
    print(f"fleet: {args.fleet} ({sum(nvlink.values())} NVLink + {MACHINES - sum(nvlink.values())} PCIe "
          f"machines × {GPUS} GPUs); {args.days:g} days; seed {args.seed}; reservation after "
          f"{args.reserve_after:g} h (4R)")
    for load in (float(x) for x in args.loads.split(",")):
        jobs = trace(args.seed, load, args.days)
        print(f"\n## load {load}\n\ntrace: {describe(jobs, period)}\n")
        rows = []
        for name in names:
            sim = Sim(jobs, name, machines, nvlink, args.reserve_after * HOUR)
            t0 = time.perf_counter()
            sim.run()
            rows.append((name, report(sim, jobs, period, time.perf_counter() - t0)))
        ideal = rows[0][1]["ideal"]
        print(table(rows))
        print(f"\n(offered in [0, T] = {ideal:.1%} of the trace's work: the rest runs after T even with no wait; "
              f"held adds what policy 1 holds idle)")
        results = dict(rows)
        if "whole" in results:
            today = results["whole"]
            print("\nratios to today (policy 1): " + "; ".join(
                f"{POLICIES[n].split(' ', 1)[0]}: used ×{r['used'] / today['used']:.2f}, 1-GPU median wait "
                f"×{r['p50'] / today['p50'] if today['p50'] else math.nan:.3f}, longest large wait "
                f"×{r['large_max'] / today['large_max'] if today['large_max'] else math.nan:.2f}"
                for n, r in rows if n != "whole"))
            print("\ngoals:")
            for n in DEVICE_LEVEL:
                if n in results:
                    print(goals(n, results[n], today, load, results.get("per-gpu")))


if __name__ == "__main__":
    main()
