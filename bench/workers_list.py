"""GET /v1/workers at scale (issue 42): 1,000 workers × 8 devices on PostgreSQL, read through one API process.

Seeded as bench/control_plane.py seeds them (`seed`: workers registered, a job running on every device, its
attempt and its hold), then made to look like a pool: a quarter of the workers with half their devices free,
one in ten idle, one device of one in 25 unhealthy, one in 50 lost (silent past the lease), labels `zone`
(a..d) and `gpu` (h100, a100). Then, sequentially (one client, the API otherwise idle but for its sweeper):

- `first page`: GET /v1/workers as the dashboard asks for it (its first page, an admin);
- `filtered`: GET /v1/workers?state=busy&label=zone=a&min_free_devices=4 (the busy workers of zone a with
  room for a 4-GPU job);
- `a user's first page`: as a user who owns a twentieth of the running jobs (the others' job ids hidden);
- `every page`: the whole list, following next_cursor (the CLI's and the SDK's `workers()`).

A route that takes no page or filter (the code before issue 42) answers every one of them with the whole list.
"""

import argparse
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import create_engine, delete, text, update
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, percentile  # noqa: E402
from bench.control_plane import (  # noqa: E402
    DEVICES,
    cpu_s,
    default_redis_url,
    device_rows,
    fresh_schema,
    seed,
    worker_id,
)
from service.auth import tokens  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.workers import holds  # noqa: E402
from service.workers.models import Hold, Worker  # noqa: E402

LEASE_S = 600.0  # long enough for the slowest run; a lost worker is one silent for 2 × LEASE_S (not yet pruned)
FILTER = {"state": "busy", "label": "zone=a", "min_free_devices": "4"}


def shape(sessions, n: int) -> dict[str, int]:
    """Free devices, idle, unhealthy and lost workers and labels on what `seed` left (every device busy)."""
    lost_since = datetime.now(UTC) - timedelta(seconds=2 * LEASE_S)
    counts = {"half_free": 0, "idle": 0, "unhealthy": 0, "lost": 0}
    with sessions() as db:
        for w in range(n):
            wid = worker_id(w)
            free = range(DEVICES) if w % 10 == 9 else range(DEVICES // 2, DEVICES) if w % 4 == 0 else ()
            values: dict = {"labels": {"zone": "abcd"[w % 4], "gpu": ("h100", "a100")[w % 2]}}
            if free:
                db.execute(delete(Hold).where(Hold.worker_id == wid, Hold.device.in_(list(free))))
                counts["idle" if len(free) == DEVICES else "half_free"] += 1
            if w % 25 == 1:  # a device that failed its health check under no job
                db.execute(delete(Hold).where(Hold.worker_id == wid, Hold.device == DEVICES - 1))
                rows = device_rows(w)
                rows[-1].update(healthy=False, reason="Xid 79: GPU has fallen off the bus")
                values["devices"] = rows
                counts["unhealthy"] += 1
            if w % 50 == 7:
                values["last_seen"] = lost_since
                counts["lost"] += 1
            db.execute(update(Worker).where(Worker.id == wid).values(**values))
            holds.sync_worker(db, worker_id=wid)  # busy_slots, state and current job follow the holds
        db.commit()
        db.execute(text("ANALYZE"))
        db.commit()
    return counts


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_s(pid) for pid in pids)


def api_backends(url: str) -> list[int]:
    """The PostgreSQL backends of the bench's database but this one's: the API's (its pool, its sweeper's)."""
    engine = create_engine(url)
    with engine.connect() as conn:
        pids = list(conn.scalars(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
                                      "backend_type = 'client backend' AND pid <> pg_backend_pid()")))
    engine.dispose()
    return pids


def idle_cores(groups: list[list[int]], seconds: float = 4.0) -> list[float]:
    """Each group's CPU with no read (the API's sweeper, in the API and in PostgreSQL), in cores: taken off what
    the reads cost."""
    cpu, t = [cpu_of(g) for g in groups], time.monotonic()
    time.sleep(seconds)
    return [(cpu_of(g) - c) / (time.monotonic() - t) for g, c in zip(groups, cpu, strict=True)]


def timed(client: httpx.Client, reads: int, params: dict, groups: list[list[int]], idle: list[float]
          ) -> tuple[list[float], list[float], int, int]:
    """`reads` sequential GETs of the first page: seconds each; the CPU seconds a read of each group of pids (the
    API process, its PostgreSQL backends: wall time on this shared machine is mostly waiting for a core, CPU is
    what a read costs); the body's bytes and its workers."""
    client.get("/v1/workers", params=params).raise_for_status()  # warm
    took, cpu, t0 = [], [cpu_of(g) for g in groups], time.monotonic()
    for _ in range(reads):
        t = time.perf_counter()
        r = client.get("/v1/workers", params=params)
        took.append(time.perf_counter() - t)
        r.raise_for_status()
    wall = time.monotonic() - t0
    spent = [max(0.0, cpu_of(g) - c - i * wall) / reads for g, c, i in zip(groups, cpu, idle, strict=True)]
    return took, spent, len(r.content), len(r.json()["items"])


def walk(client: httpx.Client) -> tuple[float, int, int]:
    """Every page, following next_cursor (one call where the route has no pages): seconds, calls, workers."""
    t, seen, calls, cursor = time.perf_counter(), [], 0, None
    while True:
        body = client.get("/v1/workers", params={"cursor": cursor} if cursor else {}).json()
        calls += 1
        seen += [w["id"] for w in body["items"]]
        if not (cursor := body.get("next_cursor")):
            break
    assert len(seen) == len(set(seen)), "a worker listed twice"
    return time.perf_counter() - t, calls, len(seen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("TRAINJOBS_BENCH_POSTGRES_URL")
                        or "postgresql+psycopg://postgres@127.0.0.1:5432/bench_wl")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--reads", type=int, default=30, help="GETs per row")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRAINJOBS_BENCH_REDIS_URL", default_redis_url())
    fresh_schema(args.url)
    engine = make_engine(args.url)
    sessions = make_sessionmaker(engine)
    t = time.perf_counter()
    seed(sessions, have=0, n=args.workers)
    counts = shape(sessions, args.workers)
    print(f"PostgreSQL {make_url(args.url).database}: {args.workers} workers × {DEVICES} devices seeded "
          f"({time.perf_counter() - t:.0f} s): {counts}", flush=True)
    with sessions() as db:
        _row, user_token = tokens.create(db, name="bench-user", user="user00")  # owns 1/20 of the running jobs
        db.commit()
    engine.dispose()  # the bench's connections closed: the database's other backends are the API's
    rows = []
    with bench_stack(workers=0, database_url=args.url, lease_s=LEASE_S) as (stack, api), \
            httpx.Client(base_url=stack.api_url, timeout=120,
                         headers={"Authorization": f"Bearer {user_token}"}) as user:
        api.timeout = httpx.Timeout(120)
        api.get("/v1/workers").raise_for_status()
        user.get("/v1/workers", params=FILTER).raise_for_status()
        groups = [[dict(stack.procs)["api"].pid], api_backends(args.url)]
        idle = idle_cores(groups)
        for name, client, params in (("first page", api, {}), ("filtered: " + "&".join(
                f"{k}={v}" for k, v in FILTER.items()), api, FILTER), ("a user's first page", user, {})):
            took, cpu, size, items = timed(client, args.reads, params, groups, idle)
            rows.append((name, percentile(took, 0.5), percentile(took, 0.99), cpu, size, items))
            print(f"  {name}: p50 {rows[-1][1] * 1000:.1f} ms, p99 {rows[-1][2] * 1000:.1f} ms, CPU a read: API "
                  f"{cpu[0] * 1000:.1f} ms, PostgreSQL {cpu[1] * 1000:.1f} ms; {size / 1000:.0f} kB, {items} workers",
                  flush=True)
        took, calls, seen = walk(api)
        print(f"  every page: {took * 1000:.0f} ms, {calls} calls, {seen} workers", flush=True)
    print(f"\nthe API's sweeper, no read: {idle[0]:.2f} cores in the API, {idle[1]:.2f} in PostgreSQL (taken off)")
    print("| read | p50 | p99 | CPU a read: API · PostgreSQL | body | workers |\n| --- | --- | --- | --- | --- | --- |")
    for name, p50, p99, cpu, size, items in rows:
        print(f"| {name} | {p50 * 1000:.1f} ms | {p99 * 1000:.1f} ms | {cpu[0] * 1000:.1f} · {cpu[1] * 1000:.1f} ms "
              f"| {size / 1000:.0f} kB | {items} |")
    print(f"| every page (following next_cursor) | {took * 1000:.0f} ms ({calls} calls) | | | | {seen} |")


if __name__ == "__main__":
    main()
