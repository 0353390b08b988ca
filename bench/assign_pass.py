"""One scheduling pass of the one scheduler (issue 42, step 5) at pool scale: plan + assign time per pass.

PostgreSQL and Redis, no API and no worker: the pool is written straight into the tables (as bench/control_plane.py
does): `--workers` shared workers of 8 GPUs each (rows with their devices, as worker/devices.py as_rows), each busy
with `--busy` 1-GPU jobs (running, attempts active, holds bound), and `--queued` queued jobs on the priority queues
(1, 2, 4 and 8 GPUs, 20 owners). Then `service.jobs.assigner.run_pass`, as the API's assigner thread runs it:

- the first pass, which assigns what fits (the free devices fill);
- then `--passes` passes on the pool as it stands (the assignments standing, unclaimed, the rest queued): what a
  pass costs while nothing changes, the common case between kicks.

Each pass's parts are timed (settle, snapshot, plan, place, assign, reasons); the goal (issue 42) is the plan's
time per pass <= 100 ms at 1,000 workers and 2,000 queued jobs. Before this, every idle lane of every worker ran a
snapshot and a plan every 0.5 s (618 ms each at 1,000 × 8: bench/control_plane.py).

`--sizes 100,250,500,1000` runs each size in turn on a fresh schema (2 queued jobs per worker, or `--queued`), and
prints how the snapshot and the plan grow with N. `--reference` also times, in CPU seconds, the plan and its old
walks over every fitting worker (tests/plan_reference.py, the plan before its indexes) on the snapshots the first
and the last steady pass planned: the same decisions, so the ratio is the indexes' alone.

    .venv/bin/python bench/assign_pass.py --url postgresql+psycopg://postgres@127.0.0.1:5432/bench_assign
    .venv/bin/python bench/assign_pass.py --sizes 100,250,500,1000 --reference
"""

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from redis import Redis
from sqlalchemy import insert, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.control_plane import GIB, SPEC, device_rows, fresh_schema  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.jobs import assigner, queue  # noqa: E402
from service.jobs.models import Attempt, Job  # noqa: E402
from service.jobs.service import hash_spec  # noqa: E402
from service.scheduling import policy  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.workers import holds  # noqa: E402
from service.workers import service as workers  # noqa: E402
from service.workers.models import Hold  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402

DEVICES = 8
PREFIX = "abp"
SIZES = (1, 1, 1, 1, 2, 2, 4, 8)  # the queued jobs' GPUs, in turn


def spec_of(gpus: int) -> JobSpec:
    return SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"nproc_per_node": gpus})})


def seed(sessions, redis: Redis, settings: Settings, *, n: int, busy: int, queued: int) -> None:
    now = datetime.now(UTC)
    for start in range(0, n, 100):
        with sessions() as db:
            rows, attempts, held = [], [], []
            for w in range(start, min(n, start + 100)):
                wid = f"{PREFIX}-w{w:05d}"
                workers.register(db, worker_id=wid, host=wid, address="10.0.0.1", device="cuda", slots=DEVICES,
                                 memory_bytes=80 * GIB, host_memory_bytes=1024 * GIB, labels={}, max_jobs=DEVICES,
                                 devices=device_rows(w))
                for d in range(busy):
                    jid = f"{PREFIX}r{w:05d}{d}"
                    rows.append(job_row(jid, SPEC, "running", now, owner=(w * DEVICES + d) % 20))
                    attempts.append({"job_id": jid, "number": 1, "worker": wid, "node_rank": 0, "status": "active",
                                     "lease_expires_at": now + timedelta(hours=1), "started_at": now})
                    held.append({"worker_id": wid, "device": d, "job_id": jid, "node_rank": 0, "attempt": 1,
                                 "since": now})
            if rows:
                db.execute(insert(Job), rows)
                db.execute(insert(Attempt), attempts)
                db.execute(insert(Hold), held)
            db.flush()
            holds.sync_workers(db, worker_ids=[f"{PREFIX}-w{w:05d}" for w in range(start, min(n, start + 100))])
            db.commit()
    waiting = [(f"{PREFIX}q{i:06d}", SIZES[i % len(SIZES)]) for i in range(queued)]
    with sessions() as db:
        db.execute(insert(Job), [job_row(jid, spec_of(g), "queued", now + timedelta(microseconds=i), owner=i % 20)
                                 for i, (jid, g) in enumerate(waiting)])
        db.execute(text("ANALYZE"))
        db.commit()
    queue.enqueue_many(redis, prefix=settings.queue_prefix, jobs=[(jid, "normal", 3600.0) for jid, _ in waiting])


def job_row(jid: str, spec: JobSpec, status: str, now: datetime, *, owner: int) -> dict:
    running = status == "running"
    return {"id": jid, "owner": f"user{owner:02d}", "name": "bench-assign", "spec": spec, "spec_hash": hash_spec(spec),
            "status": status, "priority": "normal", "attempt": 1 if running else 0, "max_retries": 0,
            "created_at": now, "queued_at": now, "started_at": now if running else None}


def show(label: str, reports: list[assigner.Report]) -> None:
    parts = reports[0].seconds
    cells = "  ".join(f"{k} {statistics.median(r.seconds[k] for r in reports) * 1000:7.1f}" for k in parts)
    total = statistics.median(sum(r.seconds.values()) for r in reports) * 1000
    print(f"{label:<28} ms (median of {len(reports)}): {cells}  | total {total:7.1f}  "
          f"| assigned {statistics.median(len(r.assigned) for r in reports):.0f}")


class Recording:
    """policy.plan, keeping the snapshot each pass planned (to time the old walks on the same one)."""

    def __init__(self) -> None:
        self.real, self.snaps = policy.plan, []

    def __call__(self, snap: policy.Snapshot) -> policy.Plan:
        self.snaps.append(snap)
        return self.real(snap)


def one_size(args, n: int, queued: int) -> dict[str, float]:
    """Seed a pool of n workers and `queued` jobs, run the first pass and the steady ones; their medians (ms)."""
    fresh_schema(args.url)
    settings = Settings(database_url=args.url, redis_url=args.redis, queue_prefix=f"{PREFIX}{os.getpid()}",
                        lease_s=3600.0, reserve_after_s=10**9)
    redis = Redis.from_url(args.redis)
    engine = make_engine(args.url)
    sessions = make_sessionmaker(engine)
    t0 = time.perf_counter()
    seed(sessions, redis, settings, n=n, busy=args.busy, queued=queued)
    print(f"seeded {n} workers x {DEVICES} GPUs ({args.busy} busy each), {queued} queued jobs "
          f"in {time.perf_counter() - t0:.1f}s")
    cache: dict = {}
    recording = Recording()
    policy.plan = recording  # the pass calls policy.plan through the module
    try:
        with sessions() as db:
            first = assigner.run_pass(db, redis, settings, cache=cache, unclaimed_s=3600.0)
        show("first pass (fills the pool)", [first])
        steady = []
        for _ in range(args.passes):
            with sessions() as db:
                steady.append(assigner.run_pass(db, redis, settings, cache=cache, unclaimed_s=3600.0))
        show("passes while nothing changes", steady)
    finally:
        policy.plan = recording.real
        for key in redis.scan_iter(f"{settings.queue_prefix}*"):
            redis.delete(key)
        engine.dispose()
    out = {"first snapshot": first.seconds["snapshot"] * 1000, "first plan": first.seconds["plan"] * 1000,
           "snapshot": statistics.median(r.seconds["snapshot"] for r in steady) * 1000,
           "plan": statistics.median(r.seconds["plan"] for r in steady) * 1000}
    if args.reference:
        from tests import plan_reference  # the old walks: kept with the test that pins the same decisions

        # CPU seconds of this process (other sessions share the 2 cores: wall time swings with their load).
        for label, snap in (("first", recording.snaps[0]), ("steady", recording.snaps[-1])):
            out[f"{label} plan cpu"] = cpu_ms(policy.plan, snap)
            out[f"{label} old walks cpu"] = cpu_ms(plan_reference.plan, snap)
            new, old = out[f"{label} plan cpu"], out[f"{label} old walks cpu"]
            print(f"{label} pass's snapshot, CPU ms: plan {new:.1f}, the old walks {old:.1f} ({old / new:.1f}x)")
    return out


def cpu_ms(plan, snap: policy.Snapshot, runs: int = 3) -> float:
    """The median CPU time of planning `snap`, in ms."""
    times = []
    for _ in range(runs):
        t = time.process_time()
        plan(snap)
        times.append(time.process_time() - t)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("TRAINJOBS_BENCH_POSTGRES_URL",
                                                        "postgresql+psycopg://postgres@127.0.0.1:5432/bench_assign"))
    parser.add_argument("--redis", default=os.environ.get("TRAINJOBS_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12"))
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--sizes", help="comma-separated numbers of workers, each run in turn (2 queued jobs each)")
    parser.add_argument("--busy", type=int, default=7, help="running 1-GPU jobs on each worker's 8 GPUs")
    parser.add_argument("--queued", type=int, help="queued jobs (default: 2 per worker)")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reference", action="store_true", help="also time the plan's old walks (tests/)")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [args.workers]
    results = {n: one_size(args, n, args.queued or 2 * n) for n in sizes}
    if len(sizes) > 1:
        keys = list(results[sizes[0]])
        print("\nworkers queued | " + " | ".join(keys) + "  (ms)")
        for n, r in results.items():
            print(f"{n:7d} {args.queued or 2 * n:6d} | " + " | ".join(f"{r[k]:.1f}" for k in keys))
        small, big = sizes[0], sizes[-1]
        print(f"from {small} to {big} workers ({big / small:.0f}x): "
              + ", ".join(f"{k} {results[big][k] / max(results[small][k], 1e-9):.1f}x" for k in keys))


if __name__ == "__main__":
    main()
