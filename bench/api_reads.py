"""What a read costs at scale: the rows of issue 15's table, measured in one run against one API process.

The API runs as users run it (`trainjobs api`, uvicorn, auth on) on PostgreSQL, loaded with --jobs jobs of
--owners owners and --points metric points (by SQL, in batches; kept between runs in the bench database,
so a second run loads nothing: `--clean` deletes them). The reads are a user's (one of the owners, with
their own token): their job, their list, the 200-step metrics of a job they submitted.

Load generators: wrk (-t2 -c50, C, so the load costs the 2-core machine less than a Python client would)
for the throughput and p99 rows, each beside /healthz in the same run; one keep-alive httpx client for
the one-client rows; an asyncio httpx client (50 tasks) for the 1,000 submissions, because wrk cannot
stop after exactly 1,000 POSTs or give each its own Idempotency-Key-free body count.

    TRAINJOBS_BENCH_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/bench_h15 \\
    TRAINJOBS_BENCH_REDIS_URL=redis://127.0.0.1:6379/12 .venv/bin/python bench/api_reads.py --jobs 1000000
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
from redis import Redis
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentile, postgres_url, redis_url  # noqa: E402
from service import migrate  # noqa: E402
from service.auth import tokens  # noqa: E402
from service.db import utcnow  # noqa: E402
from service.jobs import counts, lifecycle, queue  # noqa: E402
from service.jobs import service as jobs  # noqa: E402
from service.jobs.models import Job  # noqa: E402
from service.metrics import service as metrics  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402
from trainjobs.states import JobStatus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOADED = "api-reads-load"  # the name of the loaded jobs (and of nothing else)
SUBMITTED = "api-reads-submit"
SPEC = {"name": SUBMITTED, "strategy": "ddp", "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
        "model": {"type": "mlp", "hidden": [16]},
        "data": {"type": "synthetic_regression", "num_samples": 512, "batch_size": 16},
        "optimizer": {"type": "adamw", "lr": 0.01}, "train": {"max_steps": 200, "log_every": 1, "seed": 0}}
BATCH = 100_000
PREFIX = f"apireads{os.getpid()}"  # the API's queues: emptied at the end

LOAD_JOBS = text("""
INSERT INTO jobs (id, owner, name, spec, spec_hash, status, priority, attempt, max_retries, created_at,
                  queued_at, started_at, finished_at, progress, summary, version)
SELECT lpad(to_hex(:t0 + g), 12, '0') || lpad(to_hex(g), 8, '0'), 'user' || lpad((g % :owners)::text, 2, '0'),
       :name, CAST(:spec AS json), :hash,
       CASE g % 100 WHEN 0 THEN 'failed' WHEN 1 THEN 'cancelled' ELSE 'succeeded' END, 'normal', 1, 0,
       to_timestamp((:t0 + g) / 1000.0), to_timestamp((:t0 + g) / 1000.0),
       to_timestamp((:t0 + g) / 1000.0 + 1), to_timestamp((:t0 + g) / 1000.0 + 60),
       CAST('{"step": 20}' AS json), CAST('{"final_loss": 0.1}' AS json), 1
FROM generate_series(:start, :stop - 1) AS g
""")
# Each point job gets POINTS_PER_JOB steps of "loss": the metrics table grows as a deployment's does.
POINTS_PER_JOB = 1000
LOAD_POINTS = text("""
INSERT INTO metrics (job_id, attempt, node_rank, step, name, value, time)
SELECT j.id, 1, 0, s, 'loss', 1.0 / (s + 1), j.started_at
FROM (SELECT id, started_at FROM jobs WHERE name = :name ORDER BY id LIMIT :njobs OFFSET :offset) AS j,
     generate_series(0, :per_job - 1) AS s
""")


def load(url: str, *, n_jobs: int, n_points: int, owners: int) -> None:
    """Add loaded jobs and points up to the numbers asked (a second run adds nothing)."""
    engine = create_engine(url)
    spec = JobSpec.model_validate({**SPEC, "name": LOADED})
    with Session(engine) as db:
        have = db.scalar(select(func.count()).select_from(Job).where(Job.name == LOADED))
        t0 = int(time.time() * 1000) - 10 * n_jobs - 86_400_000  # older than anything submitted now
        started = time.monotonic()
        for start in range(have, n_jobs, BATCH):
            db.execute(LOAD_JOBS, {"t0": t0, "owners": owners, "name": LOADED, "hash": jobs.hash_spec(spec),
                                   "spec": json.dumps(spec.model_dump(mode="json")), "start": start,
                                   "stop": min(n_jobs, start + BATCH)})
            counts.compact(db)
            db.commit()
            print(f"  jobs: {min(n_jobs, start + BATCH):,} ({time.monotonic() - started:.0f}s)", flush=True)
        point_jobs = n_points // POINTS_PER_JOB
        have = db.scalar(text("SELECT count(DISTINCT job_id) FROM metrics WHERE name = 'loss' AND job_id IN "
                              "(SELECT id FROM jobs WHERE name = :name)"), {"name": LOADED})
        step = max(1, 1_000_000 // POINTS_PER_JOB)
        for offset in range(have, point_jobs, step):
            db.execute(LOAD_POINTS, {"name": LOADED, "njobs": min(step, point_jobs - offset), "offset": offset,
                                     "per_job": POINTS_PER_JOB})
            db.commit()
            print(f"  points: {min(point_jobs, offset + step) * POINTS_PER_JOB:,} ({time.monotonic() - started:.0f}s)",
                  flush=True)
        counts.compact(db)
        db.commit()
    # NOTE: a million jobs in a minute leave a million dead deltas (80 MB) that every scrape would scan until
    # autovacuum (within a minute, at its defaults) empties and truncates the table: do it now.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("jobs", "metrics", "job_count_deltas"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))
    engine.dispose()


def clean(url: str) -> None:
    engine = create_engine(url)
    with Session(engine) as db:
        for name in (LOADED, SUBMITTED):
            db.execute(text("DELETE FROM jobs WHERE name = :name"), {"name": name})
        db.commit()
    engine.dispose()


@contextmanager
def api_process(url: str, port: int, data_dir: Path, src: Path = ROOT, processes: int = 1):
    """`trainjobs api [--workers N]` as a user starts it (from the source tree src); stopped (SIGTERM) at the end."""
    env = {**os.environ, "TRAINJOBS_DATABASE_URL": url, "TRAINJOBS_REDIS_URL": redis_url(),
           "TRAINJOBS_DATA_DIR": str(data_dir), "TRAINJOBS_QUEUE_PREFIX": PREFIX,
           # 1,000 submissions of one token in a few seconds: the rate and quota limits would refuse them.
           "TRAINJOBS_SUBMIT_RATE_PER_MIN": "1000000", "TRAINJOBS_QUOTA_ACTIVE_JOBS": "1000000"}
    output = open(data_dir.parent / "api.log", "w")  # noqa: SIM115 - closed below, after the process
    env["PYTHONPATH"] = str(src)
    more = ["--workers", str(processes)] if processes > 1 else []
    proc = subprocess.Popen([sys.executable, "-m", "service.cli.main", "api", "--port", str(port), *more], env=env,
                            cwd=src, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the API did not start")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    except BaseException:
        print("the API's output, last lines:\n" + "".join(open(output.name).readlines()[-30:]), file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        output.close()


def wrk(url: str, *, seconds: int, headers: dict[str, str] | None = None) -> tuple[float, float]:
    """(requests/s, p99 in ms) of `wrk -t2 -c50`; a non-2xx/3xx answer fails the bench."""
    argv = ["wrk", "-t2", "-c50", f"-d{seconds}s", "--latency"]
    for name, value in (headers or {}).items():
        argv += ["-H", f"{name}: {value}"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, check=True).stdout
    if "Non-2xx or 3xx responses" in out:
        raise RuntimeError(f"wrk saw errors on {url}:\n{out}")
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    value, unit = re.search(r"99%\s+([\d.]+)(us|ms|s)", out).groups()
    return rate, float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def one_client(client: httpx.Client, path: str, n: int, headers: dict[str, str] | None = None,
               vary: Callable[[int], str] | None = None) -> float:
    """p50 in ms of n sequential requests on one kept-alive connection; with vary, each its own query (path
    + vary(i)): none answered from what the API kept of an earlier one."""
    took = []
    for i in range(n):
        started = time.perf_counter()
        r = client.get(path + (vary(i) if vary else ""), headers=headers)
        took.append(time.perf_counter() - started)
        assert r.status_code in (200, 304), (path, r.status_code, r.text[:200])
    return statistics.median(took) * 1e3


# wrk's threads each stop after their share of the submissions (a Lua state per thread); a request in flight then
# is abandoned, so the server may store a few more than n (the bench deletes them all at the end).
WRK_POSTS = """
wrk.method = "POST"
wrk.body = [==[%(body)s]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
local done = 0
function response(status, headers, body)
  done = done + 1
  if done >= %(each)d then wrk.thread:stop() end
end
"""


def wrk_submissions(base: str, token: str, n: int, url: str) -> tuple[float, float, float, int]:
    """(submissions/s, p50 ms, p99 ms, answered) of about n POST /v1/jobs by `wrk -t2 -c50` (n/2 a thread).

    The rate is the database's: jobs stored ÷ (the last one's created_at - the start). wrk's own divides by its
    whole -d, which it sleeps out after its threads stopped."""
    engine = create_engine(url)
    started = utcnow()
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_POSTS % {"body": json.dumps(SPEC), "token": token, "each": n // 2})
        script.flush()
        out = subprocess.run(["wrk", "-t2", "-c50", "-d60s", "--latency", "-s", script.name, f"{base}/v1/jobs"],
                             capture_output=True, text=True, check=True).stdout
    if "Non-2xx or 3xx responses" in out:
        raise RuntimeError(f"wrk saw errors on POST /v1/jobs:\n{out}")
    answered = int(re.search(r"(\d+) requests in", out).group(1))
    with Session(engine) as db:
        stored, last = db.execute(select(func.count(), func.max(Job.created_at))
                                  .where(Job.name == SUBMITTED, Job.created_at >= started)).one()
    engine.dispose()
    rate = stored / (last - started).total_seconds()
    p50, p99 = (float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
                for value, unit in (re.search(rf"{q}%\s+([\d.]+)(us|ms|s)", out).groups() for q in (50, 99)))
    return rate, p50, p99, answered


async def submissions(base: str, token: str, n: int, concurrency: int) -> tuple[float, float, float, int]:
    """(submissions/s, p50 ms, p99 ms, connection errors) of n POST /v1/jobs by `concurrency` tasks.

    A connection the server closed under the client (httpx's ReadError: seen in about 1 run in 5 of 1,000, on
    this and earlier commits alike) is counted and the submission sent again, not the run abandoned."""
    took: list[float] = []
    errors = 0
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60,
                                 limits=limits) as client:
        async def submit_some() -> None:
            nonlocal errors
            for _ in todo:
                started = time.perf_counter()
                try:
                    r = await client.post("/v1/jobs", json=SPEC)
                except httpx.TransportError:
                    errors += 1
                    r = await client.post("/v1/jobs", json=SPEC)
                took.append(time.perf_counter() - started)
                assert r.status_code == 201, r.text[:300]

        started = time.perf_counter()
        await asyncio.gather(*(submit_some() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return n / wall, percentile(took, 0.5) * 1e3, percentile(took, 0.99) * 1e3, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--points", type=int, default=10_000_000)
    parser.add_argument("--owners", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=10, help="each wrk run")
    parser.add_argument("--requests", type=int, default=300, help="each one-client row")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--clean", action="store_true", help="delete the loaded jobs and points, then stop")
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (trainjobs api --workers N)")
    parser.add_argument("--api-src", type=Path, default=ROOT,
                        help="run the API from this source tree (an older commit's `git archive`, for a before/after)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed (apt-get install -y wrk)")
    url = postgres_url()
    migrate.upgrade(url)
    if args.clean:
        clean(url)
        return
    print(f"loading up to {args.jobs:,} jobs of {args.owners} owners and {args.points:,} points ...", flush=True)
    load(url, n_jobs=args.jobs, n_points=args.points, owners=args.owners)
    engine = create_engine(url)
    with Session(engine) as db:
        db.execute(text("DELETE FROM jobs WHERE name = :name"), {"name": SUBMITTED})  # a crashed run's, if any
        db.commit()
        stored = db.scalar(select(func.count()).select_from(Job))
        points = db.scalar(text("SELECT count(*) FROM metrics"))
        _, secret = tokens.create(db, name="api-reads", user="user07")
    print(f"stored: {stored:,} jobs, {points:,} metric points")
    user = {"Authorization": f"Bearer {secret}"}
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-") as tmp, \
            api_process(url, args.port, Path(tmp) / "data", args.api_src, args.api_workers) as base, \
            httpx.Client(base_url=base, headers=user, timeout=30) as client:
        job = client.post("/v1/jobs", json=SPEC).json()
        with Session(engine) as db:  # it ran 200 steps (its ETag then holds: a queued job's pending reason moves)
            attempt, _ = lifecycle.claim(db, job_id=job["id"], worker="bench", lease_s=60)
            lifecycle.start_running(db, job_id=job["id"], attempt=attempt, detail="bench")
            lifecycle.finish_node(db, job_id=job["id"], attempt=attempt, node_rank=0, status=JobStatus.SUCCEEDED,
                                  summary={"final_loss": 0.005}, error=None, exit_code=0)
            # ...and its series, as a worker ships it (block summaries too)
            metrics.insert_batch(db, job_id=job["id"], attempt=1,
                                 rows=[(s, name, 1.0 / (s + 1), utcnow()) for s in range(200)
                                       for name in ("loss", "samples_per_s", "step_time_s")])
            db.commit()
        path = f"/v1/jobs/{job['id']}"
        etag = client.get(path).headers["etag"]
        assert client.get(path).json()["status"] == "succeeded"
        rows = []
        health_rate, health_p99 = wrk(f"{base}/healthz", seconds=args.seconds)
        read_rate, read_p99 = wrk(base + path, seconds=args.seconds, headers=user)
        cached_rate, _ = wrk(base + path, seconds=args.seconds, headers={**user, "If-None-Match": etag})
        assert client.get(path, headers={"If-None-Match": etag}).status_code == 304  # they were all 304s
        health_again, _ = wrk(f"{base}/healthz", seconds=args.seconds)
        health = (health_rate + health_again) / 2
        rows.append(("GET /v1/jobs/{id} req/s ÷ /healthz req/s", f"{read_rate / health:.2f}",
                     f"{read_rate:,.0f} vs {health:,.0f}/s (/healthz {health_rate:,.0f} before, "
                     f"{health_again:,.0f} after)"))
        rows.append(("the same read, p99 at 50 connections", f"{read_p99:.0f} ms",
                     f"/healthz's own p99 {health_p99:.0f} ms (its first run)"))
        rows.append(("a 304 poll (If-None-Match) ÷ /healthz", f"{cached_rate / health:.2f}",
                     f"{cached_rate:,.0f} vs {health:,.0f}/s"))
        healthz_p50 = one_client(client, "/healthz", args.requests)
        read_p50 = one_client(client, path, args.requests)
        rows.append(("one client, GET /v1/jobs/{id} p50", f"{read_p50:.1f} ms", f"/healthz {healthz_p50:.2f} ms"))
        list_p50 = one_client(client, "/v1/jobs?limit=50", args.requests)
        rows.append((f"one client, GET /v1/jobs?limit=50 ({stored:,} jobs stored)", f"{list_p50:.1f} ms",
                     "a user's own jobs"))
        chart_p50 = one_client(client, f"{path}/metrics?max_points=500", args.requests)
        cold_p50 = one_client(client, f"{path}/metrics?max_points=", args.requests, vary=lambda i: str(500 - i % 300))
        rows.append(("one client, GET /v1/jobs/{id}/metrics?max_points=500, a 200-step job", f"{chart_p50:.1f} ms",
                     f"3 series, polled; {cold_p50:.1f} ms for a chart not kept (max_points=N, a new N each time)"))
        scrape_p50 = one_client(client, "/metrics", max(10, args.requests // 10))
        rows.append((f"GET /metrics ({stored:,} jobs stored)", f"{scrape_p50:.1f} ms", ""))
        for what, value, beside in rows:
            print(f"| {what} | {value} | {beside} |", flush=True)
        rate, p50, p99, answered = wrk_submissions(base, secret, 1000, url)
        rows.append(("1,000 submissions at 50 concurrent (wrk)", f"{rate:.0f}/s",
                     f"p50 {p50:.0f} ms, p99 {p99:.0f} ms ({answered} answered)"))
        print("| {} | {} | {} |".format(*rows[-1]), flush=True)
        rate, p50, p99, errors = asyncio.run(submissions(base, secret, 1000, 50))
        rows.append(("1,000 submissions at 50 concurrent (asyncio httpx)", f"{rate:.0f}/s",
                     f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, {errors} connection errors (each sent again; "
                     "the client's CPU shares the 2 cores)"))
    redis = Redis.from_url(redis_url())
    for priority in queue.PRIORITIES:
        queue.get_queue(redis, PREFIX, priority).empty()
    redis.close()
    with Session(engine) as db:
        db.execute(text("DELETE FROM jobs WHERE name = :name"), {"name": SUBMITTED})
        db.execute(text("DELETE FROM api_tokens WHERE name = 'api-reads'"))
        db.commit()
    engine.dispose()
    print("\n| what | measured | beside it |\n| --- | --- | --- |")
    for what, value, beside in rows:
        print(f"| {what} | {value} | {beside} |")


if __name__ == "__main__":
    main()
