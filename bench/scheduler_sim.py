"""A simulated month of the pool (issue 16): today's FIFO-with-priorities vs the fair policy, same trace.

Pure Python, seeded, no torch and no database: an event-driven simulation that calls the production decision,
`service.scheduling.policy.plan`, at every event (a submission, a job's end, a preemption's hand-back, and the
moments a rule may change its mind: a `high` job reaching preempt_after_s or a victim reaching min_runtime_s,
a gang reaching reserve_after_s), and starts what the plan assigns.

The pool: 32 machines × 8 GPUs. A trainjobs worker runs one job at a time, with `slots` = the GPUs it was
given, so the deployment decides what a small job costs. The one simulated here, as an operator would deploy
a mixed workload: 30 machines run one 8-slot worker each (8-GPU jobs and every gang), 1 machine runs two 4-slot
workers (CUDA_VISIBLE_DEVICES=0-3 and 4-7), 1 machine runs eight 1-slot workers: 40 workers. Best fit sends a
1-GPU job to a 1-slot worker when one is free; when none is, it takes the next smallest (a 4- or 8-slot worker,
whose other GPUs then idle: that is the cost of one job per worker, and it is counted as unused).

The trace: 20 users in 4 teams of 5 (every weight 1); user u00 submits 5× as many jobs as each other user,
in sweeps of 10-40 at once; the others submit one at a time, mostly in working hours. Sizes from 1 GPU to
8 nodes × 8 GPUs; a timeout of 30 min to 48 h chosen as a user would (a round figure above what they expect),
the actual runtime below it (heavy-tailed: lognormal). Priorities: 80% normal, 10% high, 10% low. A preempted
job loses the work since its last checkpoint (every 30 min), holds its workers for a 60 s hand-back, and goes
back to the queue with what remains; it keeps its submission time (FIFO within its owner) and re-queues.

Usage per owner is decayed device-seconds (half-life 7 days), running jobs included, integrated exactly
between events. FIFO is `Settings(policy="fifo")` with preemption and reservations off (infinite thresholds);
fair is `Settings()` (preempt_after_s 60, min_runtime_s 600, reserve_after_s 300, reserve_deadline_s 48 h, one
reservation at a time; `--max-reservations N` for more).

Fairness: Jain's index over users with demand of x_i = a_i / e_i, where a_i is the GPU-seconds user i held
and e_i its max-min fair entitlement: the pool's delivered GPU-seconds water-filled over the users' demands
(the GPU-seconds of the work they submitted), so a user who asked for less than an equal share is entitled
to what they asked for, and the rest is split equally among those who asked for more. 1.0 = every user got
exactly their entitlement. Reported over the month and as the mean over the month's four weeks (a fair-share policy
acts on recent usage, so the weekly figure is the closer test of it). A week's demand is what the user still
owed at its start plus what they submitted in it; a day is too short a window for jobs of up to 40 h.
"""

import argparse
import heapq
import math
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.scheduling import policy  # noqa: E402
from service.workers import fit  # noqa: E402

DAY = 86400.0
MONTH = 30 * DAY
HALF_LIFE_S = 7 * DAY
CHECKPOINT_EVERY_S = 1800.0
HANDBACK_S = 60.0
TIMEOUTS = [1800.0, 3600.0, 2 * 3600.0, 4 * 3600.0, 8 * 3600.0, 12 * 3600.0, 24 * 3600.0, 48 * 3600.0]
# size class: (share of jobs, GPUs per node, nodes, median runtime s, lognormal sigma)
SIZES = {
    "1 GPU": (0.40, 1, 1, 1.0 * 3600, 1.2),
    "4 GPU": (0.15, 4, 1, 2.0 * 3600, 1.1),
    "8 GPU": (0.22, 8, 1, 3.0 * 3600, 1.1),
    "2×8": (0.11, 8, 2, 4.0 * 3600, 1.0),
    "4×8": (0.08, 8, 4, 5.0 * 3600, 1.0),
    "8×8": (0.04, 8, 8, 6.0 * 3600, 1.0),
}


@dataclass
class Job:
    id: str
    owner: str
    size: str
    slots: int
    nodes: int
    priority: str
    timeout_s: float
    work_s: float  # runtime still to do
    submitted: float
    queued: float
    started: float | None = None
    workers: tuple[str, ...] = ()
    progress_at_start: float = 0.0  # work_s when this attempt started
    attempt: int = 0
    preempt_requested: bool = False
    preempted_for: str = ""  # the waiting job this attempt was preempted for (bench/scheduler_sim_audit.py)
    first_start: float | None = None
    waits: list[float] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.slots * self.nodes


def deployment() -> list[policy.Node]:
    nodes = [policy.Node(f"m{i:02d}", "cuda", 8) for i in range(30)]
    nodes += [policy.Node(f"m30-{i}", "cuda", 4) for i in range(2)]
    nodes += [policy.Node(f"m31-{i}", "cuda", 1) for i in range(8)]
    return nodes


def trace(seed: int, load: float) -> list[Job]:
    """A month of submissions whose GPU-seconds of work are `load` × the pool's (256 GPUs × 30 days)."""
    rng = random.Random(seed)
    users = [f"u{i:02d}" for i in range(20)]
    kinds = list(SIZES)
    weights = [SIZES[k][0] for k in kinds]
    mean_work = sum(w * SIZES[k][1] * SIZES[k][2] * SIZES[k][3] * math.exp(SIZES[k][4] ** 2 / 2)
                    for k, w in zip(kinds, weights, strict=True))
    n_jobs = int(load * 256 * MONTH / mean_work)
    # u00 gets 5 shares of the jobs, each other user 1: 5 / 24 of them, in sweeps.
    heavy_n = n_jobs * 5 // 24
    jobs: list[Job] = []

    def submit_time() -> float:
        while True:  # working hours weigh 3× the night; weekends half
            t = rng.uniform(0, MONTH)
            hour, weekday = (t % DAY) / 3600, int(t // DAY) % 7
            accept = (1.0 if 9 <= hour < 19 else 0.33) * (0.5 if weekday >= 5 else 1.0)
            if rng.random() < accept:
                return t

    def draw(owner: str, t: float) -> Job:
        kind = rng.choices(kinds, weights)[0]
        _, slots, nodes, median, sigma = SIZES[kind]
        work = min(max(rng.lognormvariate(math.log(median), sigma), 600.0), 40 * 3600.0)
        want = work * rng.uniform(1.1, 2.0)
        timeout = next((x for x in TIMEOUTS if x >= want), TIMEOUTS[-1])
        r = rng.random()
        prio = "high" if r < 0.10 else "low" if r < 0.20 else "normal"
        return Job("", owner, kind, slots, nodes, prio, timeout, work, t, t)

    while sum(1 for j in jobs if j.owner == "u00") < heavy_n:
        t = submit_time()
        for k in range(rng.randint(10, 40)):
            jobs.append(draw("u00", t + k))
    per_light = (n_jobs - heavy_n) // 19
    for user in users[1:]:
        for _ in range(per_light):
            jobs.append(draw(user, submit_time()))
    jobs.sort(key=lambda j: (j.submitted, j.owner))
    for i, j in enumerate(jobs):
        j.id = f"j{i:05d}"
    return jobs


def accounts() -> dict[str, policy.Account]:
    return {f"u{i:02d}": policy.Account(team=f"team{i // 5}") for i in range(20)}


class Sim:
    """One policy over one trace: events in time order, a plan after each instant's events."""

    def __init__(self, jobs: list[Job], settings: policy.Settings, nodes: list[policy.Node]) -> None:
        self.jobs = {j.id: Job(**{**j.__dict__, "waits": []}) for j in jobs}
        self.settings = settings
        self.nodes = nodes
        self.busy: dict[str, str] = {}  # worker -> job
        self.waiting: dict[str, Job] = {}
        self.running: dict[str, Job] = {}
        self.usage: dict[str, float] = defaultdict(float)
        self.held: dict[str, int] = defaultdict(int)  # owner -> GPUs held now
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.gpu_s_held = 0.0
        self.gpu_s_lost = 0.0
        self.day_alloc: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.preemptions = 0
        self.plans = 0
        self.plan_s = 0.0
        for j in self.jobs.values():
            self.push(j.submitted, "submit", j.id)

    def push(self, t: float, kind: str, job_id: str = "", attempt: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, job_id, attempt))

    def advance(self, t: float) -> None:
        """Usage and accounting from self.now to t, with the GPUs held constant in between."""
        dt = t - self.now
        if dt <= 0:
            return
        decay = 0.5 ** (dt / HALF_LIFE_S)
        gain = HALF_LIFE_S / math.log(2) * (1 - decay)  # ∫ of the decay over dt, per GPU held
        for owner in list(self.usage) + [o for o in self.held if o not in self.usage]:
            self.usage[owner] = self.usage[owner] * decay + self.held[owner] * gain
        total = sum(self.held.values())
        self.gpu_s_held += total * min(dt, max(0.0, MONTH - self.now))
        # per-day allocation, split at midnight
        a = self.now
        while a < t and a < MONTH:
            b = min(t, (math.floor(a / DAY) + 1) * DAY)
            for owner, g in self.held.items():
                if g:
                    self.day_alloc[int(a // DAY)][owner] += g * (b - a)
            a = b
        self.now = t

    def start(self, job: Job, workers: list[str]) -> None:
        del self.waiting[job.id]
        job.started, job.workers, job.attempt = self.now, tuple(workers), job.attempt + 1
        job.progress_at_start = job.work_s
        job.waits.append(self.now - job.queued)
        if job.first_start is None:
            job.first_start = self.now
        for w in workers:
            self.busy[w] = job.id
        self.running[job.id] = job
        self.held[job.owner] += job.gpus
        self.push(self.now + job.work_s, "end", job.id, job.attempt)

    def release(self, job: Job) -> None:
        for w in job.workers:
            del self.busy[w]
        del self.running[job.id]
        self.held[job.owner] -= job.gpus
        job.workers, job.started, job.preempt_requested = (), None, False

    def snapshot(self) -> policy.Snapshot:
        waiting = [policy.Waiting(j.id, j.owner, j.priority, j.priority, j.submitted, j.queued,
                                  fit.Need("cuda", j.slots, None, None, nodes=j.nodes), j.timeout_s)
                   for j in self.waiting.values()]
        running = [policy.Running(j.id, j.owner, j.priority, j.slots, j.nodes, j.started, j.timeout_s, j.workers,
                                  preempt_requested=j.preempt_requested) for j in self.running.values()]
        nodes = [policy.Node(n.id, n.device, n.slots, running=self.busy.get(n.id)) for n in self.nodes]
        return policy.Snapshot(self.now, waiting, running, nodes, dict(self.usage), ACCOUNTS, {}, self.settings)

    def step(self) -> None:
        snap = self.snapshot()
        t0 = time.perf_counter()
        result = policy.plan(snap)
        self.plan_s += time.perf_counter() - t0
        self.plans += 1
        for place in result.order:
            if place.workers:
                job = self.waiting[place.job_id]
                assert len(place.workers) == job.nodes and not any(w in self.busy for w in place.workers), place
                self.start(job, place.workers)
        for p in result.preemptions:
            victim = self.running[p.victim]
            assert not victim.preempt_requested and victim.priority != "high"
            victim.preempt_requested, victim.preempted_for = True, p.for_job
            self.preemptions += 1
            self.push(self.now + HANDBACK_S, "handback", victim.id, victim.attempt)
        self.wake(result)

    def wake(self, result: policy.Plan) -> None:
        """The next moment a rule may decide differently with no event in between."""
        cfg, later = self.settings, []
        highs = [j for j in self.waiting.values() if j.priority == "high"]
        for j in highs:
            later.append(j.queued + cfg.preempt_after_s)
        if highs:
            later += [j.started + cfg.min_runtime_s for j in self.running.values() if j.priority != "high"]
        later += [j.queued + cfg.reserve_after_s for j in self.waiting.values() if j.nodes > 1]
        nxt = min((t for t in later if self.now < t < math.inf), default=None)
        if nxt is not None and nxt < MONTH + 30 * DAY:
            self.push(nxt, "wake")

    def run(self) -> None:
        while self.events:
            t = self.events[0][0]
            if t > MONTH and not self.running and not self.waiting:
                break
            self.advance(t)
            while self.events and self.events[0][0] == t:
                _, _, kind, job_id, attempt = heapq.heappop(self.events)
                job = self.jobs.get(job_id)
                if kind == "submit":
                    self.waiting[job.id] = job
                elif kind == "end" and job.attempt == attempt and job.id in self.running:
                    job.work_s = 0.0
                    self.release(job)
                elif kind == "handback" and job.attempt == attempt and job.id in self.running:
                    done = self.now - HANDBACK_S - job.started
                    kept = math.floor(done / CHECKPOINT_EVERY_S) * CHECKPOINT_EVERY_S
                    self.gpu_s_lost += job.gpus * (self.now - job.started - kept)
                    job.work_s = job.progress_at_start - kept
                    self.release(job)
                    job.queued = self.now
                    self.waiting[job.id] = job
            if self.waiting:
                self.step()


def water_fill(demand: dict[str, float], total: float) -> dict[str, float]:
    """Max-min fair entitlements of `total` over the demands."""
    out, left, users = {}, total, sorted(demand, key=demand.get)
    for i, u in enumerate(users):
        level = left / (len(users) - i)
        out[u] = min(demand[u], level)
        left -= out[u]
    return out


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 1.0


def fairness(alloc: dict[str, float], demand: dict[str, float]) -> float:
    users = [u for u in demand if demand[u] > 0]
    ent = water_fill({u: demand[u] for u in users}, sum(alloc.get(u, 0.0) for u in users))
    return jain([alloc.get(u, 0.0) / ent[u] for u in users if ent[u] > 0])


def demand_by_day(jobs: list[Job]) -> dict[int, dict[str, float]]:
    """A day's demand: the work submitted that day plus what was still owed from before (a backlog is demand)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for j in jobs:
        out[int(j.submitted // DAY)][j.owner] += j.gpus * j.work_s
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def report(name: str, sim: Sim, jobs: list[Job], wall: float) -> dict:
    cap = 256 * MONTH
    done = [j for j in sim.jobs.values() if j.first_start is not None]
    # fairness over the month: allocation within the month vs the work submitted in it
    month_alloc: dict[str, float] = defaultdict(float)
    for day in sim.day_alloc.values():
        for u, g in day.items():
            month_alloc[u] += g
    demand: dict[str, float] = defaultdict(float)
    for j in jobs:
        demand[j.owner] += j.gpus * j.work_s
    month_f = fairness(month_alloc, demand)
    # weekly: demand = the backlog owed at the week's start + that week's submissions (carried by a running sum)
    owed: dict[str, float] = defaultdict(float)
    subs = demand_by_day(jobs)
    weekly = []
    for week in range(4):  # days 0-27: four whole weeks
        alloc: dict[str, float] = defaultdict(float)
        for d in range(7 * week, 7 * week + 7):
            for u, w in subs[d].items():
                owed[u] += w
            for u, g in sim.day_alloc[d].items():
                alloc[u] += g
        dem = {u: w for u, w in owed.items() if w > 1}
        weekly.append(fairness(alloc, dem))
        for u, g in alloc.items():
            owed[u] = max(0.0, owed[u] - g)
    waits: dict[str, list[float]] = defaultdict(list)
    by_user: dict[str, list[float]] = defaultdict(list)
    for j in done:
        waits[j.size].append(j.first_start - j.submitted)
        by_user["u00" if j.owner == "u00" else "others"].append(j.first_start - j.submitted)
    multi = [w for j in sim.jobs.values() if j.nodes > 1 for w in j.waits]
    multi_by_priority: dict[str, float] = defaultdict(float)
    for j in sim.jobs.values():
        if j.nodes > 1 and j.waits:
            multi_by_priority[j.priority] = max(multi_by_priority[j.priority], max(j.waits))
    return {
        "name": name, "util": sim.gpu_s_held / cap, "useful": (sim.gpu_s_held - sim.gpu_s_lost) / cap,
        "jain_month": month_f, "jain_weekly": sum(weekly) / len(weekly), "jain_weekly_min": min(weekly),
        "user_waits": {k: (pct(v, 0.5), pct(v, 0.95)) for k, v in by_user.items()},
        "waits": {k: (pct(v, 0.5), pct(v, 0.95)) for k, v in waits.items()},
        "multi_max": max(multi, default=0.0), "multi_by_priority": dict(multi_by_priority),
        "preemptions": sim.preemptions, "lost_h": sim.gpu_s_lost / 3600,
        "plans": sim.plans, "plan_ms": 1000 * sim.plan_s / max(sim.plans, 1), "wall": wall,
        "unstarted": sum(1 for j in sim.jobs.values() if j.first_start is None),
        "heavy_share": month_alloc["u00"] / max(sum(month_alloc.values()), 1.0),
    }


def fmt_h(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


ACCOUNTS = accounts()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.85, help="the trace's work ÷ the pool's GPU-seconds, "
                        "before the clipping of runtimes to [10 min, 40 h] (which adds ~5%%)")
    parser.add_argument("--max-reservations", type=int, default=policy.Settings().max_reservations,
                        help="the fair arm's TRAINJOBS_MAX_RESERVATIONS")
    args = parser.parse_args()
    jobs = trace(args.seed, args.load)
    nodes = deployment()
    by_size = defaultdict(int)
    for j in jobs:
        by_size[j.size] += 1
    work = sum(j.gpus * j.work_s for j in jobs) / (256 * MONTH)
    print(f"trace: {len(jobs)} jobs (seed {args.seed}), work {work:.2f} × the pool; "
          + ", ".join(f"{k} {by_size[k]}" for k in SIZES) + f"; workers {len(nodes)}")
    inf = math.inf
    arms = [("fifo", policy.Settings(policy="fifo", preempt_after_s=inf, reserve_after_s=inf)),
            ("fair", policy.Settings(max_reservations=args.max_reservations))]
    results = []
    for name, settings in arms:
        sim = Sim(jobs, settings, nodes)
        t0 = time.perf_counter()
        sim.run()
        results.append(report(name, sim, jobs, time.perf_counter() - t0))
    longest_timeout = max(j.timeout_s for j in jobs)
    bound = policy.Settings().reserve_after_s + longest_timeout
    for r in results:
        print(f"\n[{r['name']}] utilisation {r['util']:.1%} (useful {r['useful']:.1%}); Jain month "
              f"{r['jain_month']:.3f}, weekly mean {r['jain_weekly']:.3f} (min {r['jain_weekly_min']:.3f}); "
              f"u00 held {r['heavy_share']:.1%}; preemptions {r['preemptions']} costing {r['lost_h']:.0f} "
              f"GPU-h; longest multi-node wait {fmt_h(r['multi_max'])}; never started {r['unstarted']}")
        print("  wait p50 / p95: " + "; ".join(f"{k} {fmt_h(p50)} / {fmt_h(p95)}"
                                                for k in SIZES for p50, p95 in [r["waits"].get(k, (0, 0))]))
        print("  wait p50 / p95 by user: " + "; ".join(f"{k} {fmt_h(a)} / {fmt_h(b)}"
                                                     for k, (a, b) in sorted(r["user_waits"].items())))
        print("  longest multi-node wait by priority: " + "; ".join(
            f"{p} {fmt_h(r['multi_by_priority'][p])}" for p in ("high", "normal", "low")
            if p in r["multi_by_priority"]))
        print(f"  {r['plans']} plans, {r['plan_ms']:.1f} ms each; {r['wall']:.1f} s")
    fifo, fair = results
    print(f"\ngoals (fair): utilisation within 3 points of FIFO: {fair['util'] - fifo['util']:+.1%} "
          f"{'met' if fair['util'] >= fifo['util'] - 0.03 else 'NOT met'}; fairness ≥ 0.9: "
          f"{'met' if min(fair['jain_month'], fair['jain_weekly']) >= 0.9 else 'NOT met'} (month, weekly mean); "
          f"multi-node wait ≤ "
          f"{fmt_h(bound)} (reserve_after_s + longest timeout): "
          f"{'met' if fair['multi_max'] <= bound else 'NOT met'}")


if __name__ == "__main__":
    main()
