"""What polling costs the API, against a live uvicorn on PostgreSQL.

(a) 200 concurrent pollers of GET /v1/jobs/{id}, with If-None-Match (a 304 without a body) and without (the
    whole job every time), in alternating rounds of one run: requests/s and p99 of each, and the ratios.
(b) GET /v1/jobs/{id}/metrics?max_points=500 over a 1M-point series (written in 50k-point batches): p50 against
    the 50 ms goal, beside the same call over a 10k-point series, and a /metrics scrape with those points stored.

The jobs this bench makes are deleted at the end (their points go with them).
"""

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from sqlalchemy import delete, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, percentile, postgres_url  # noqa: E402
from service.auth import tokens  # noqa: E402
from service.auth.models import ApiToken, User  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.jobs.models import Job  # noqa: E402
from service.metrics import service as metrics  # noqa: E402

SPEC = {
    "name": "bench-polling",
    "resources": {"nproc_per_node": 2},
    "model": {"type": "mlp", "hidden": [64, 64]},
    "data": {"type": "synthetic_regression", "num_samples": 4096, "batch_size": 64},
    "train": {"max_steps": 1_000_000, "log_every": 10},
}
GOAL_P50_S = 0.050
LOADED_AT = datetime(2026, 12, 2, tzinfo=UTC)


async def poll_round(base_url: str, headers: dict, path: str, *, pollers: int, seconds: float,
                     etag: str | None) -> tuple[float, list[float], int, int]:
    """`pollers` loops hammering `path` for `seconds`; (requests/s, latencies, 304s, dropped connections)."""
    limits = httpx.Limits(max_connections=pollers, max_keepalive_connections=pollers)
    latencies: list[float] = []
    not_modified = dropped = 0
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=60) as client:
        deadline = time.perf_counter() + seconds

        async def poller() -> None:
            nonlocal not_modified, dropped
            request_headers = {"If-None-Match": etag} if etag else {}
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    r = await client.get(path, headers=request_headers)
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # NOTE: an overloaded uvicorn closes a kept-alive connection whose next request it has not
                    # read within its keep-alive timeout (5 s): counted, and the poller goes on
                    dropped += 1
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code == 304:
                    not_modified += 1
                elif r.status_code != 200:
                    raise RuntimeError(f"GET {path}: HTTP {r.status_code} {r.text[:200]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(poller() for _ in range(pollers)))
        wall = time.perf_counter() - t0
    return len(latencies) / wall, latencies, not_modified, dropped


def bench_etag(stack, api: httpx.Client, *, pollers: int, rounds: int, seconds: float) -> None:
    job = api.post("/v1/jobs", json=SPEC).json()
    # Finished, so that nothing (the sweeper's pending_reason of a queued job) changes it during the rounds.
    api.post(f"/v1/jobs/{job['id']}/cancel").raise_for_status()
    path = f"/v1/jobs/{job['id']}"
    first = api.get(path)
    etag, size = first.headers["ETag"], len(first.content)
    assert api.get(path, headers={"If-None-Match": etag}).status_code == 304
    results: dict[str, list] = {"etag": [], "plain": []}
    for r in range(rounds):
        for mode in (("etag", "plain") if r % 2 == 0 else ("plain", "etag")):  # alternate who goes first
            rate, latencies, hits, dropped = asyncio.run(poll_round(
                stack.api_url, dict(api.headers), path, pollers=pollers, seconds=seconds,
                etag=etag if mode == "etag" else None))
            if mode == "etag":
                assert hits == len(latencies), "every conditional poll should have been a 304"
            results[mode].append((rate, percentile(latencies, 0.99)))
            print(f"  round {r + 1} {mode:5}: {rate:7.0f} req/s, p99 {percentile(latencies, 0.99) * 1000:6.1f} ms"
                  + (f" ({dropped} connections dropped by the server)" if dropped else ""))
    rate = {m: statistics.median(x[0] for x in v) for m, v in results.items()}
    p99 = {m: statistics.median(x[1] for x in v) for m, v in results.items()}
    print(f"(a) {pollers} pollers of GET /v1/jobs/{{id}} ({size} B body), {rounds} rounds of {seconds:.0f} s each:")
    print(f"    requests/s  If-None-Match (304) / plain (200): {rate['etag'] / rate['plain']:.2f}"
          f"   [{rate['etag']:.0f} vs {rate['plain']:.0f} req/s]")
    print(f"    p99 latency plain / If-None-Match: {p99['plain'] / p99['etag']:.2f}"
          f"   [{p99['plain'] * 1000:.1f} vs {p99['etag'] * 1000:.1f} ms]")


def load_points(url: str, job_id: str, n: int, *, batch: int = 50_000) -> float:
    """n points of one `loss` series, written as a worker writes them (metrics.insert_batch: the rows and their
    block summaries) in big batches; returns the seconds it took."""
    rng = random.Random(0)
    spikes = {n // 3: -50.0, 2 * n // 3: 70.0}  # what a stride would miss and a min/max thinning keeps
    engine = make_engine(url)
    t0 = time.perf_counter()
    with make_sessionmaker(engine)() as db:
        for start in range(0, n, batch):
            rows = [(step, "loss", spikes.get(step, math.sin(step / (n / 20)) + rng.gauss(0, 0.1)), LOADED_AT)
                    for step in range(start, min(n, start + batch))]
            metrics.insert_batch(db, job_id=job_id, attempt=1, rows=rows)
            db.commit()
        db.execute(text("ANALYZE metrics"))
        db.commit()
    engine.dispose()
    return time.perf_counter() - t0


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(api: httpx.Client, path: str, params: dict, repeats: int) -> tuple[list[float], httpx.Response]:
    api.get(path, params=params)  # warm: connection, plans, caches
    times, r = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = api.get(path, params=params)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
    return times, r


def bench_downsample(api: httpx.Client, url: str, *, points: int, repeats: int) -> None:
    big = api.post("/v1/jobs", json=SPEC).json()["id"]
    small = api.post("/v1/jobs", json=SPEC).json()["id"]
    load_s = load_points(url, big, points)
    load_points(url, small, 10_000)
    print(f"(b) {points:,} points written by metrics.insert_batch in {load_s:.1f} s ({points / load_s:,.0f} points/s)")
    params = {"name": "loss", "max_points": 500}
    big_times, r = timed(api, f"/v1/jobs/{big}/metrics", params, repeats)
    (series,) = r.json()["series"]
    steps, values = series["steps"], series["values"]
    assert len(steps) <= 500 and steps[-1] == points - 1 and min(values) == -50.0 and max(values) == 70.0, \
        "the thinned series lost its shape"
    small_times, _ = timed(api, f"/v1/jobs/{small}/metrics", params, repeats)
    scrape_times, _ = timed(api, "/metrics", {}, max(3, repeats // 4))
    p50, small_p50 = statistics.median(big_times), statistics.median(small_times)
    print(f"    max_points=500 over {points:,} points: p50 / goal (50 ms): {p50 / GOAL_P50_S:.2f}"
          f"   [p50 {p50 * 1000:.1f} ms, p95 {percentile(big_times, 0.95) * 1000:.1f} ms, {repeats} calls,"
          f" {len(steps)} points back]")
    print(f"    1M-point p50 / 10k-point p50: {p50 / small_p50:.1f}   [10k: {small_p50 * 1000:.1f} ms]")
    print(f"    GET /metrics with them stored: p50 {statistics.median(scrape_times) * 1000:.1f} ms (context)")
    engine = make_engine(url)
    with make_sessionmaker(engine)() as db:  # in-process: the thinning alone, both ways, on the same series
        by_points = [seconds(lambda: metrics.thin_points(db, job_id=big, name="loss", after_step=None,
                                                         max_points=500)) for _ in range(3)]
        by_blocks = [seconds(lambda: metrics.read_thinned(db, job_id=big, name="loss", max_points=500))
                     for _ in range(repeats)]
    engine.dispose()
    old, new = statistics.median(by_points), statistics.median(by_blocks)
    print(f"    thinning in-process, from the points / from the block summaries: {old / new:.0f}"
          f"   [{old * 1000:.0f} vs {new * 1000:.1f} ms]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    url = postgres_url()
    print(f"PostgreSQL {url.rsplit('@', 1)[-1]}; uvicorn (one process), no worker")
    with bench_stack(workers=0, database_url=url) as (stack, _api):
        engine = make_engine(url)
        made_user = False
        if stack.settings.auth and stack.token is None:
            # A database that already has an admin (say, the tests'): a token of the bench's own, so that
            # the polls pay for authentication as a real client's do.
            with make_sessionmaker(engine)() as db:
                made_user = db.get(User, "bench") is None
                _row, stack.token = tokens.create(db, name="bench-polling", user="bench", role="admin")
        try:
            with stack.client(timeout=60) as api:
                bench_etag(stack, api, pollers=args.pollers, rounds=args.rounds, seconds=args.seconds)
                bench_downsample(api, url, points=args.points, repeats=args.repeats)
        finally:
            with engine.begin() as conn:  # this bench's jobs (their points go with them) and its token
                conn.execute(delete(Job).where(Job.name == SPEC["name"]))
                conn.execute(delete(ApiToken).where(ApiToken.name == "bench-polling"))
                if made_user:
                    conn.execute(delete(User).where(User.name == "bench"))
            engine.dispose()


if __name__ == "__main__":
    main()
