"""Metric ingest through the worker API on PostgreSQL (issue 42): 8 attempts flooding `POST /v1/worker/ship` at once.

The "after" of bench/job_writes.py's ingest case (whose shipping processes wrote the database themselves): the same
8 jobs running (`bench.control_plane.seed`: one simulated worker × 8 devices, each job with its attempt), a runner
credential (`bench.worker_api.make_runners`), a real API process (`Stack`, auth on, its sweeper on), and 8 client
threads, one per attempt, each shipping its `--points` in batches of `--batch` (steps × `--names` series, a time per
step, as `MetricTail` cuts them), one after another with no wait: the most the API and the database take.

Each batch's body is encoded before the clock starts (a worker builds it on its own machine; what that costs a
worker is printed apart), in either points form the API takes: `rows` ([[step, name, value, unix time], ...]) or
`columns` (service/runners/points.py). "Kept" is the metrics rows counted in the database after the run, divided by
the wall from the first batch sent to the last acknowledged. CPU per point: the API processes' and their PostgreSQL
backends' (from /proc). `--py-spy FILE` samples the API process meanwhile (collapsed stacks, for where its time goes).

    TRAINJOBS_BENCH_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/bench_ingest_api \\
    TRAINJOBS_BENCH_REDIS_URL=redis://127.0.0.1:6379/7 .venv/bin/python bench/metric_ingest_api.py \\
        [--encoding rows|columns] [--points 200000] [--batch 10000] [--api-workers 1]
"""

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, percentile, postgres_url, redis_url  # noqa: E402
from bench.control_plane import DEVICES, cpu_s, fresh_schema, job_id, seed  # noqa: E402
from bench.worker_api import api_pids, backends, make_runners  # noqa: E402
from service.cli.stack import Stack  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.settings import Settings  # noqa: E402

NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb", "acc", "ppl", "loss_ema", "throughput")


def batch_points(first_step: int, steps: int, names: tuple[str, ...], t0: float) -> list[tuple]:
    """`steps` steps of every name from first_step on, a time per step (a step's points share their time)."""
    return [(step, name, random.random(), t0 + step * 0.01) for step in range(first_step, first_step + steps)
            for name in names]


def encode(points: list[tuple], encoding: str) -> list | dict:
    """The batch's points in the form asked for (service/runners/points.py reads either)."""
    if encoding == "rows":
        return [list(p) for p in points]
    from service.runners.points import PointColumns  # (a tree before it takes rows only: --encoding rows)

    return PointColumns.of(points).model_dump()


def bodies(jid: str, *, points: int, batch: int, names: tuple[str, ...], encoding: str) -> tuple[list[bytes], float]:
    """The job's ship bodies as JSON bytes, seq 1, 2, ...; and the CPU-seconds encoding took (a worker's cost)."""
    steps_per_batch, t0, out, took = max(1, batch // len(names)), time.time(), [], 0.0
    for seq, first in enumerate(range(0, points // len(names), steps_per_batch), start=1):
        raw = batch_points(first, min(steps_per_batch, points // len(names) - first), names, t0)
        started = time.process_time()
        out.append(json.dumps({"job_id": jid, "attempt": 1, "node_rank": 0, "seq": seq,
                               "points": encode(raw, encoding)}).encode())
        took += time.process_time() - started
    return out, took


def flood(api_url: str, secret: str, batches: list[bytes], start: threading.Barrier, out: dict) -> None:
    """One attempt's batches, one after another; each must be applied."""
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    latencies = []
    with httpx.Client(base_url=api_url, timeout=120, headers=headers) as client:
        client.get("/healthz")  # the keep-alive connection made before the clock starts
        start.wait()
        out["began"] = time.monotonic()
        for body in batches:
            t = time.perf_counter()
            r = client.post("/v1/worker/ship", content=body)
            latencies.append(time.perf_counter() - t)
            if r.status_code != 200 or not r.json()["applied"]:
                raise SystemExit(f"ship refused: HTTP {r.status_code} {r.text[:500]}")
        out["ended"] = time.monotonic()
    out["latencies"] = latencies


def profile(pid: int, path: Path) -> subprocess.Popen | None:
    """py-spy sampling the API process (and its threads) until stopped, as collapsed stacks."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--output",
                             str(path), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args) -> dict:
    url = postgres_url()
    dbname = url.rsplit("/", 1)[1].split("?")[0]
    fresh_schema(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    seed(sessions, have=0, n=1)  # one worker, 8 jobs running, each with its attempt
    secrets: dict[int, str] = {}
    make_runners(sessions, have=0, n=1, into=secrets)
    names = NAMES[:args.names]
    jobs = [job_id(0, d) for d in range(DEVICES)][:args.jobs]
    encoded = [bodies(jid, points=args.points, batch=args.batch, names=names, encoding=args.encoding) for jid in jobs]
    data = Path(tempfile.mkdtemp(prefix="bench-ingest-api-"))
    settings = Settings(database_url=url, redis_url=redis_url(), data_dir=data, auth=True, lease_s=3600.0,
                        queue_prefix=f"ingest{free_port()}")
    with Stack(settings, port=free_port(), workers=0, quiet=True, api_workers=args.api_workers) as stack:
        start = threading.Barrier(len(jobs))
        outs: list[dict] = [{} for _ in jobs]
        threads = [threading.Thread(target=flood, args=(stack.api_url, secrets[0], batches, start, out), daemon=True)
                   for (batches, _), out in zip(encoded, outs, strict=True)]
        apis = api_pids(stack)
        spy = profile(apis[-1], args.py_spy) if args.py_spy else None
        pg0 = {pid: cpu_s(pid) for pid in backends(sessions, dbname)}
        api0 = sum(cpu_s(p) for p in apis)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pg1 = backends(sessions, dbname)
        pg = sum(max(0.0, cpu_s(pid) - pg0.get(pid, 0.0)) for pid in set(pg0) | set(pg1))
        api = sum(cpu_s(p) for p in apis) - api0
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            spy.wait(30)
    if any("ended" not in out for out in outs):
        raise SystemExit("a client thread failed (above)")
    wall = max(o["ended"] for o in outs) - min(o["began"] for o in outs)
    with sessions() as db:
        kept = db.scalar(text("SELECT count(*) FROM metrics WHERE job_id = ANY(:ids)"), {"ids": jobs})
    engine.dispose()
    shutil.rmtree(data, ignore_errors=True)
    latencies = [x for o in outs for x in o["latencies"]]
    sent = sum(len(b) for batches, _ in encoded for b in batches)
    return {"encoding": args.encoding, "jobs": len(jobs), "batch": args.batch, "names": len(names),
            "api_workers": args.api_workers, "points_sent": len(jobs) * (args.points // len(names)) * len(names),
            "points_kept": kept, "wall_s": round(wall, 2), "kept_per_s": round(kept / wall),
            "api_cpu_us_per_point": api * 1e6 / kept, "pg_cpu_us_per_point": pg * 1e6 / kept,
            "bytes_per_point": sent / kept,
            "encode_us_per_point": sum(took for _, took in encoded) * 1e6 / kept,
            "ship_p50_ms": percentile(latencies, 0.5) * 1000, "ship_p99_ms": percentile(latencies, 0.99) * 1000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoding", choices=("rows", "columns"), default="columns")
    parser.add_argument("--jobs", type=int, default=DEVICES)
    parser.add_argument("--points", type=int, default=200_000, help="points each job ships")
    parser.add_argument("--batch", type=int, default=10_000, help="points a ship carries")
    parser.add_argument("--names", type=int, default=10, help="series a step reports")
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (uvicorn --workers)")
    parser.add_argument("--py-spy", type=Path, help="sample the API process into this file (collapsed stacks)")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    r = run(args)
    print(f"{r['encoding']}: {r['jobs']} jobs × {r['points_sent'] // r['jobs']:,} points in batches of {r['batch']:,}"
          f" ({r['api_workers']} API process(es)): kept {r['points_kept']:,} of {r['points_sent']:,} in "
          f"{r['wall_s']} s = {r['kept_per_s']:,} points/s; CPU per point: API {r['api_cpu_us_per_point']:.2f} µs, "
          f"PostgreSQL {r['pg_cpu_us_per_point']:.2f} µs; {r['bytes_per_point']:.1f} bytes/point, the worker's "
          f"encoding {r['encode_us_per_point']:.2f} µs/point; ship p50 {r['ship_p50_ms']:.0f} / p99 "
          f"{r['ship_p99_ms']:.0f} ms", flush=True)
    if r["points_kept"] != r["points_sent"]:
        raise SystemExit(f"kept {r['points_kept']} of {r['points_sent']} points")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
