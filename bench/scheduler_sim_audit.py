"""Where the devices preemption frees go: bench/scheduler_sim.py's fair arm, audited (issue 30).

Each victim's hand-back marks its workers as freed for the job it was preempted for; the next job to start on
such a worker is counted as that job, another job while that one still waited (the devices were not kept for
it, so it may preempt again), or another job after it had started (a worker it did not need: a gang victim's
other machines). `--victims most-workers` ranks victims the way the rule before issue 30 did (the ones freeing
the most workers first), to compare the two rules on one trace in one version of the code.

    .venv/bin/python bench/scheduler_sim_audit.py [--seed 16] [--load 0.85] [--victims most-workers]
"""

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scheduler_sim as sim  # noqa: E402
from service.scheduling import preemption  # noqa: E402

WAITED, AFTER = "another while it waited", "another after it started"


class AuditedSim(sim.Sim):
    """The simulation, counting what each preemption freed and who started on it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.freed_for: dict[str, str] = {}  # worker -> the job a victim's hand-back freed it for
        self.victims: Counter = Counter()  # (beneficiary's size, victim's size) -> hand-backs
        self.per_job: Counter = Counter()  # beneficiary -> hand-backs for it
        self.went: Counter = Counter()  # (beneficiary's size, who started on it, their size) -> workers

    def release(self, job: sim.Job) -> None:
        if job.preempt_requested:
            for_job = self.jobs[job.preempted_for]
            self.victims[for_job.size, job.size] += 1
            self.per_job[for_job.id] += 1
            for w in job.workers:
                self.freed_for[w] = for_job.id
        super().release(job)

    def start(self, job: sim.Job, workers: list[str]) -> None:
        for w in workers:
            if (for_id := self.freed_for.pop(w, None)) is not None:
                who = "it" if for_id == job.id else WAITED if for_id in self.waiting else AFTER
                self.went[self.jobs[for_id].size, who, job.size] += 1
        super().start(job, workers)


def rank_by_workers_freed() -> None:
    """Victims freeing the most workers first, then the fewest, then issue 30's rank: the rule before issue 30's
    first keys, on today's code (it reproduces that rule's figures at seeds 16 and 17)."""
    original = preemption._option

    def option(m, there, need, spare, wanted, nodes, first):
        found = original(m, there, need, spare, wanted, nodes, first)
        if found is None:
            return None
        freed = {w for r in found.victims for w in r.workers if w in spare}
        return replace(found, rank=(-len(freed), found.rank[1], found.rank[0], *found.rank[2:]))

    preemption._option = option


def report(run: AuditedSim) -> None:
    by_size: dict[str, list[int]] = defaultdict(list)
    for job_id, n in run.per_job.items():
        by_size[run.jobs[job_id].size].append(n)
    print("preemptions (counted at hand-back), by the size of the job they were for:")
    for size in sim.SIZES:
        counts = by_size.get(size)
        if not counts:
            continue
        victims = ", ".join(f"{v} {n}" for (b, v), n in sorted(run.victims.items(), key=lambda x: -x[1]) if b == size)
        went = {who: sum(n for (b, w, _), n in run.went.items() if b == size and w == who)
                for who in ("it", WAITED, AFTER)}
        freed = sum(n for (b, _, _), n in run.went.items() if b == size)
        print(f"  {size}: {sum(counts)} for {len(counts)} jobs (most for one: {max(counts)}); victims {victims}; "
              f"workers freed {freed}: to it {went['it']}, to {WAITED} {went[WAITED]}, to {AFTER} {went[AFTER]}")
    for who in (WAITED, AFTER):
        takers = Counter()
        for (_, w, taker), n in run.went.items():
            if w == who:
                takers[taker] += n
        print(f"  workers to {who}, by the taker's size: " + ", ".join(f"{k} {n}" for k, n in takers.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.85)
    parser.add_argument("--victims", choices=["issue-30", "most-workers"], default="issue-30")
    args = parser.parse_args()
    if args.victims == "most-workers":
        rank_by_workers_freed()
    jobs = sim.trace(args.seed, args.load)
    run = AuditedSim(jobs, sim.policy.Settings(), sim.deployment())
    run.run()
    r = sim.report("fair", run, jobs, 0.0)
    w8 = [j.first_start - j.submitted for j in run.jobs.values() if j.size == "8 GPU"]
    print(f"[fair, victims {args.victims}] seed {args.seed}: utilisation {r['util']:.1%} (useful {r['useful']:.1%}); "
          f"Jain {r['jain_month']:.3f} / {r['jain_weekly']:.3f}; preemptions {r['preemptions']} costing "
          f"{r['lost_h']:.0f} GPU-h; longest multi-node wait {sim.fmt_h(r['multi_max'])}")
    print("  wait p50 / p95: " + "; ".join(f"{k} {sim.fmt_h(a)} / {sim.fmt_h(b)}" for k in sim.SIZES
                                            for a, b in [r["waits"].get(k, (0, 0))])
          + f"; 8 GPU longest {sim.fmt_h(max(w8))}")
    report(run)


if __name__ == "__main__":
    main()
