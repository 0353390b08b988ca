"""The control plane at scale (issue 30): simulated workers × 8 devices against PostgreSQL and one API process.

No torch, no worker process: the bench calls the functions a worker calls, on the cadence it calls them.
Seeded per step of N (added to what the smaller N seeded): N workers (`workers.register`: cuda, slots 8,
max_jobs 8, eight device rows as worker/devices.py `as_rows` gives them) and 8N jobs `running` on them, each
with the attempt and the device hold that `lifecycle.claim` + `holds.bind` leave. Then, for a bounded window:

- each worker's heartbeat every heartbeat_s: `workers.beat` (it sweeps the worker's stale holds), commit;
- each attempt's lease every heartbeat_s: `lifecycle.hold` in a transaction of its own (worker/lease.py);
- each attempt's ship every poll_s, as worker/supervisor.py `_commit`/`_write` does it: `lifecycle.still_held`
  (the fence), `logs.append` of the new output, `metrics.insert_batch` of the new points (the ranks report a
  step of POINT_NAMES once a second: one batch of 10 points a second), `metrics.replace_samples` (usage, every
  usage_sample_s), `records.record_progress`, commit. A ship run late carries what was due at its time, so its
  cost is the real cadence's at any N (about half the ships carry nothing new: their cost is counted apart);
- idle lanes' dispatcher polls (`scheduling.snapshot` + `policy.plan`, every dispatch.POLL_S each, a warm Req
  cache): one idle lane per 100 workers (most devices busy), in a process of their own;
- the API (`trainjobs api` through service/cli/stack.py, auth on) runs its sweeper (its own snapshot every
  sweep_s) and answers a dashboard's GET /v1/workers and GET /v1/jobs?status=running, once a second each;
  after the window, with the load stopped, the API process's CPU a read and its sweeper's are measured.

Each kind of operation has its own threads and connections (--threads), so the CPU of its PostgreSQL backends
(/proc of the pids pg_stat_activity gives, by application_name) is its cost. This machine cannot offer the load
(one Python process drives it): what the offered load needs of PostgreSQL is each kind's cost an op × its
offered rate (`demand`). The lease is set long (LEASE_S) for the API and the bench alike, so a renewal served
late never expires a job mid-run: the state stays the same across steps, and lateness shows as achieved <
offered.
"""

import argparse
import heapq
import json
import math
import multiprocessing
import os
import random
import sys
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import create_engine, delete, insert, text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, percentile  # noqa: E402
from service import migrate  # noqa: E402
from service.auth import tokens  # noqa: E402
from service.auth.models import ApiToken, User  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.jobs import lifecycle, records  # noqa: E402
from service.jobs.models import Attempt, Job  # noqa: E402
from service.jobs.service import hash_spec  # noqa: E402
from service.logs import service as logs  # noqa: E402
from service.metrics import service as metrics  # noqa: E402
from service.scheduling import policy  # noqa: E402
from service.scheduling import service as scheduling  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.workers import holds  # noqa: E402
from service.workers import service as workers  # noqa: E402
from service.workers.models import Hold, Worker  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402

DEVICES = 8
LEASE_S = 3600.0  # see the module's docstring: no job expires mid-run, however late its renewal
PREFIX = "cpb"  # every worker and job id the bench makes starts with it
NAME = "bench-control-plane"
POINT_NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb", "acc", "ppl", "loss_ema",
               "throughput")
IDLE_POLL_S = 0.5  # worker/dispatch.py POLL_S
KINDS = ("beat", "lease", "ship", "poll")
EMPTY = "ship_empty"  # the ships with nothing new: what they cost PostgreSQL is counted apart
SPEC = JobSpec.model_validate({
    "name": NAME, "resources": {"nproc_per_node": 1, "device": "cuda"},
    "model": {"type": "mlp", "hidden": [64]},
    "data": {"type": "synthetic_regression", "num_samples": 4096, "batch_size": 64},
    "train": {"max_steps": 10_000_000, "log_every": 1}})
GIB = 2**30


def default_redis_url() -> str:
    for name in ("TRAINJOBS_BENCH_REDIS_URL", "TRAINJOBS_TEST_REDIS_URL"):
        if os.environ.get(name):
            return os.environ[name]
    password = Path("/var/lib/redis/trainjobs-test.password")
    auth = f":{password.read_text().strip()}@" if password.is_file() else ""
    return f"redis://{auth}127.0.0.1:6380/5"


def fresh_schema(url: str) -> None:
    """Create the database if missing, drop and recreate its schema, migrate it."""
    name = make_url(url).database
    admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}) is None:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    migrate.upgrade(url)


def device_rows(w: int) -> list[dict]:
    """Eight GPUs as worker/devices.py as_rows gives them."""
    return [{"index": d, "uuid": f"GPU-{w:08x}-0000-0000-0000-{d:012x}", "memory_bytes": 80 * GIB, "healthy": True,
             "numa_node": d // 4, "cores": list(range(d * 4, d * 4 + 4)), "reason": None} for d in range(DEVICES)]


def worker_id(w: int) -> str:
    return f"{PREFIX}-w{w:05d}"


def job_id(w: int, d: int) -> str:
    return f"{PREFIX}{w:05d}{d}"


def seed(sessions, *, have: int, n: int) -> float:
    """Workers have..n-1 registered, busy with one job per device (what claim + bind leave); returns seconds."""
    t0 = time.perf_counter()
    now = datetime.now(UTC)
    spec_hash = hash_spec(SPEC)
    for start in range(have, n, 100):
        ws = range(start, min(n, start + 100))
        with sessions() as db:
            for w in ws:
                workers.register(db, worker_id=worker_id(w), host=f"gpu{w:05d}", address=f"10.1.{w // 250}.{w % 250}",
                                 device="cuda", slots=DEVICES, memory_bytes=80 * GIB, host_memory_bytes=1024 * GIB,
                                 labels={}, max_jobs=DEVICES, devices=device_rows(w))
            jobs, attempts, held = [], [], []
            for w in ws:
                for d in range(DEVICES):
                    place = {"node_rank": 0, "attempt": 1, "devices": [d], "kind": "cuda",
                             "uuids": [device_rows(w)[d]["uuid"]], "visible": str(d),
                             "cores": list(range(d * 4, d * 4 + 4))}
                    jobs.append({"id": job_id(w, d), "owner": f"user{(w * DEVICES + d) % 20:02d}", "name": NAME,
                                 "spec": SPEC, "spec_hash": spec_hash, "status": "running", "priority": "normal",
                                 "attempt": 1, "max_retries": 0, "created_at": now, "queued_at": now,
                                 "started_at": now, "progress": {"step": 0}, "placement": [place]})
                    attempts.append({"job_id": job_id(w, d), "number": 1, "worker": worker_id(w), "node_rank": 0,
                                     "status": "active", "lease_expires_at": now + timedelta(seconds=LEASE_S),
                                     "started_at": now, "placement": place})
                    held.append({"worker_id": worker_id(w), "device": d, "job_id": job_id(w, d), "node_rank": 0,
                                 "attempt": 1, "since": now})
            db.execute(insert(Job), jobs)
            db.execute(insert(Attempt), attempts)
            db.execute(insert(Hold), held)
            for w in ws:
                holds.sync_worker(db, worker_id=worker_id(w))
            db.commit()
    with sessions() as db:
        db.execute(text("ANALYZE"))
        db.commit()
    return time.perf_counter() - t0


class JobState:
    """What one simulated supervisor knows of its job: the ranks' step clock, what it shipped."""

    __slots__ = ("id", "t0", "shipped", "offset", "seq", "sampled")

    def __init__(self, jid: str, t0: float, sampled: float):
        self.id, self.t0, self.shipped, self.offset, self.seq, self.sampled = jid, t0, 0, 0, 1, sampled


class Schedule:
    """Open-loop, fixed-rate operations of one kind: every item is due every period_s from a staggered start; a
    thread takes the earliest due item, waits for it, runs it and puts it back one period later. Threads that
    fall behind run items late: achieved < offered."""

    def __init__(self, items: list, period_s: float, t0: float, deadline: float):
        self.period_s, self.deadline, self.t0 = period_s, deadline, t0
        rng = random.Random(len(items))
        self.firsts = [t0 + rng.random() * period_s for _ in items]
        self.heap = [(due, i) for i, due in enumerate(self.firsts)]
        heapq.heapify(self.heap)
        self.items, self.lock = items, threading.Lock()
        self.latencies: list[float] = []
        self.done = self.lost = self.errors = 0
        self.cpu_s = 0.0

    def offered(self) -> int:
        return sum(max(0, math.floor((self.deadline - f) / self.period_s) + 1) for f in self.firsts
                   if f <= self.deadline)

    def result(self) -> dict:
        return {"offered": self.offered(), "done": self.done, "lost": self.lost, "errors": self.errors,
                "latencies": self.latencies, "cpu_s": self.cpu_s}

    def run(self, op) -> None:
        cpu0 = time.thread_time()
        latencies, done = [], 0
        while True:
            with self.lock:
                due, i = heapq.heappop(self.heap)
                if due > self.deadline:
                    heapq.heappush(self.heap, (due, i))
                    break
                heapq.heappush(self.heap, (due + self.period_s, i))
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            if time.monotonic() > self.deadline:
                break
            t = time.perf_counter()
            try:
                ok = op(self.items[i], due)
            except Exception as exc:  # noqa: BLE001 - counted and shown; the bench goes on
                with self.lock:
                    self.errors += 1
                    if self.errors <= 3:
                        print(f"    {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            latencies.append(time.perf_counter() - t)
            done += 1
            if not ok:
                with self.lock:
                    self.lost += 1
        with self.lock:
            self.latencies += latencies
            self.done += done
            self.cpu_s += time.thread_time() - cpu0


class Ops:
    """The worker's calls, each in its own transaction, as worker/inventory.py, lease.py and supervisor.py make
    them."""

    def __init__(self, url: str, settings: Settings, points_per_s: float):
        self.settings, self.points_per_s = settings, points_per_s
        # A ship with nothing new (the supervisor ships every poll_s; the ranks report once a second) goes through
        # an engine of its own, so that its PostgreSQL cost is told apart from a ship with points.
        self.engines = {k: make_engine(url, application_name=f"{PREFIX}-bench-{k}") for k in (*KINDS, EMPTY)}
        self.empty_ships, self.empty_latencies = 0, []
        self.sessions = {k: make_sessionmaker(e) for k, e in self.engines.items()}
        self.points = 0
        # The lanes' Req cache (Chooser.reqs), warm as a long-running worker's is: shared, so it is parsed once.
        self.reqs: dict = {}

    def beat(self, wid: str, _due: float = 0.0) -> bool:
        with self.sessions["beat"]() as db:
            found = workers.beat(db, worker_id=wid)
            db.commit()
        return found

    def lease(self, job: JobState, _due: float = 0.0) -> bool:
        with self.sessions["lease"]() as db:
            held = lifecycle.hold(db, job_id=job.id, attempt=1, node_rank=0, lease_s=LEASE_S)
            if held is None:
                db.rollback()
                return False
            db.commit()
        return True

    def ship(self, job: JobState, due: float) -> bool:
        """The ship due at `due` (monotonic) carries what the ranks reported by then: a ship run late is the same
        ship, so its cost is the real cadence's at any N (the lateness shows as achieved < offered)."""
        step = min(int((due - job.t0) * self.points_per_s / len(POINT_NAMES)), job.shipped + 1000)
        steps = range(job.shipped + 1, step + 1)
        stamp = datetime.now(UTC)
        sample = due - job.sampled >= self.settings.usage_sample_s and step > 0
        began = time.perf_counter()
        with self.sessions["ship" if steps or sample else EMPTY]() as db:
            if lifecycle.still_held(db, job_id=job.id, attempt=1, node_rank=0) is None:
                db.rollback()
                return False
            written = 0
            if steps:
                out = "".join(f"step {s} loss {1 / s:.5f} lr 3.0e-04 grad_norm 0.91 tokens/s 51234\n" for s in steps)
                written = logs.append(db, job_id=job.id, attempt=1, start=job.offset, seq=job.seq, text=out)
            rows = [(s, name, 1.0 / (s + k), stamp) for s in steps for k, name in enumerate(POINT_NAMES)]
            metrics.insert_batch(db, job_id=job.id, attempt=1, node_rank=0, rows=rows)
            if sample:
                metrics.replace_samples(db, job_id=job.id, attempt=1, node_rank=0,
                                        rows=[(step, "gpu_util", 97.0, stamp), (step, "gpu_mem", 61.5, stamp)])
            if step > 0:
                records.record_progress(db, job_id=job.id, attempt=1, progress={
                    "step": step, "total": SPEC.train.max_steps, "step_time_s": 1.0, "eta_s": 1e7 - step})
            db.commit()
        if steps:
            job.shipped, job.offset, job.seq = step, job.offset + written, job.seq + 1
            self.points += len(rows)
        if sample:
            job.sampled = due
        if not (steps or sample):
            self.empty_ships += 1
            self.empty_latencies.append(time.perf_counter() - began)
        return True

    def poll(self, _lane: int, _due: float = 0.0) -> bool:
        with self.sessions["poll"]() as db:
            snap = scheduling.snapshot(db, self.settings, cache=self.reqs)
            policy.plan(snap)
        return True

    def dispose(self) -> None:
        for engine in self.engines.values():
            engine.dispose()


def poller(url: str, lanes: int, threads: int, lease_s: float, inbox, outbox) -> None:
    """The idle lanes' polls, in a process of their own: a snapshot costs a pool-sized Python loop (each lane's
    own process pays it on a real worker), and in the bench's process it would hold the GIL from the other
    kinds' threads. Warms the Req cache, says so, runs the window it is given, sends its result."""
    ops = Ops(url, Settings(database_url=url, lease_s=lease_s), 0.0)
    engine = ops.engines["poll"]
    conns = [engine.connect() for _ in range(threads)]
    for c in conns:
        c.close()
    ops.poll(0)
    outbox.put("ready")
    t0, deadline = inbox.get()
    schedule = Schedule(list(range(lanes)), IDLE_POLL_S, t0, deadline)
    pool = [threading.Thread(target=schedule.run, args=(ops.poll,), daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    outbox.put(schedule.result())
    inbox.get()  # the bench has read its backends' CPU: they may go
    ops.dispose()


def backends(db, dbname: str) -> dict[int, str]:
    """pid -> whose backend: a bench kind's, the API's (every other client on the bench's database), or the
    server's own processes (WAL writer, checkpointer, autovacuum: shared with every database, context only)."""
    rows = db.execute(text("SELECT pid, application_name, datname, backend_type FROM pg_stat_activity "
                           "WHERE pid <> pg_backend_pid()")).all()
    out = {}
    for pid, app, datname, backend_type in rows:
        if backend_type != "client backend":
            out[pid] = "server"
        elif datname == dbname:
            out[pid] = next((k for k in (*KINDS, EMPTY) if app == f"{PREFIX}-bench-{k}"), "api")
    return out


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def dashboard(base_url: str, headers: dict, deadline: float, out: dict[str, list[float]]) -> None:
    """A dashboard polling the pool: GET /v1/workers and GET /v1/jobs?status=running, once a second each."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        while time.monotonic() < deadline:
            began = time.monotonic()
            for key, path, params in (("workers", "/v1/workers", {}),
                                      ("running", "/v1/jobs", {"status": "running"})):
                t = time.perf_counter()
                r = client.get(path, params=params)
                r.raise_for_status()
                out[key].append(time.perf_counter() - t)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))


def read_costs(api: httpx.Client, api_pid: int, *, idle_s: float = 4.0, reads: int = 4) -> dict:
    """With the load stopped: the API process's CPU a read (its CPU over a few sequential reads, less what its
    sweeper spent over as long, measured just before with no reads). CPU, not wall time: this machine's other
    work slows a read's wall time, not its CPU."""
    cpu, t = cpu_s(api_pid), time.monotonic()
    time.sleep(idle_s)
    sweeper = (cpu_s(api_pid) - cpu) / (time.monotonic() - t)
    out = {"sweeper_cores": sweeper}
    for key, path, params in (("workers", "/v1/workers", {}), ("running", "/v1/jobs", {"status": "running"})):
        api.get(path, params=params).raise_for_status()
        cpu, t = cpu_s(api_pid), time.monotonic()
        for _ in range(reads):
            r = api.get(path, params=params)
            r.raise_for_status()
        spent = cpu_s(api_pid) - cpu - sweeper * (time.monotonic() - t)
        out[key] = max(0.0, spent) * 1000 / reads
        out[f"{key}_bytes"] = len(r.content)
    return out


def run_step(url: str, dbname: str, monitor, api, stack, settings: Settings, n: int, *, seconds: float, threads: dict,
             points_per_s: float, idle_per_100: float) -> dict:
    ops = Ops(url, settings, points_per_s)
    lanes = max(1, round(n * idle_per_100 / 100)) if idle_per_100 > 0 else 0
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    polls = ctx.Process(target=poller, args=(url, lanes, threads["poll"], LEASE_S, inbox, outbox), daemon=True)
    if lanes:
        polls.start()
        assert outbox.get(timeout=300) == "ready"
    # Every connection open before the window, so that pg_stat_activity lists each backend the window uses.
    for kind in ("beat", "lease", "ship", EMPTY):
        conns = [ops.engines[kind].connect() for _ in range(threads[kind if kind != EMPTY else "ship"])]
        for c in conns:
            c.close()
    t0 = time.monotonic() + 1.0
    deadline = t0 + seconds
    # The ranks' step clocks and the usage samples at random phases: a job's first ship in the window is as likely
    # to carry nothing new as any later one (on this machine most jobs get one ship a window at N >= 250).
    rng = random.Random(n)
    jobs = [JobState(job_id(w, d), t0 - rng.random(), t0 - rng.random() * settings.usage_sample_s)
            for w in range(n) for d in range(DEVICES)]
    schedules = {"beat": Schedule([worker_id(w) for w in range(n)], settings.heartbeat_s, t0, deadline),
                 "lease": Schedule(jobs, settings.heartbeat_s, t0, deadline),
                 "ship": Schedule(jobs, settings.poll_s, t0, deadline)}
    api_reads: dict[str, list[float]] = {"workers": [], "running": []}
    with monitor() as db:
        pids = backends(db, dbname)
        size0 = db.scalar(text("SELECT pg_database_size(:d)"), {"d": dbname})
    api_pid = stack.procs[0][1].pid
    cpu0 = {pid: cpu_s(pid) for pid in pids}
    api_cpu0, bench_cpu0 = cpu_s(api_pid), time.process_time()
    if lanes:
        inbox.put((t0, deadline))
    pool = [threading.Thread(target=schedules[k].run, args=(getattr(ops, k),), daemon=True)
            for k in schedules for _ in range(threads[k])]
    pool.append(threading.Thread(target=dashboard, args=(stack.api_url, dict(api.headers), deadline, api_reads),
                                 daemon=True))
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=seconds + 120)
    results = {k: sch.result() for k, sch in schedules.items()}
    results["poll"] = outbox.get(timeout=seconds + 120) if lanes else Schedule([], 1, t0, deadline).result()
    wall = time.monotonic() - t0
    with monitor() as db:
        pids_after = backends(db, dbname)
        size1 = db.scalar(text("SELECT pg_database_size(:d)"), {"d": dbname})
    pg_cpu: dict[str, float] = defaultdict(float)
    for pid, kind in {**pids, **pids_after}.items():
        pg_cpu[kind] += max(0.0, cpu_s(pid) - cpu0.get(pid, 0.0))  # (a backend gone since: its CPU is lost)
    api_cpu, bench_cpu = cpu_s(api_pid) - api_cpu0, time.process_time() - bench_cpu0
    ops.dispose()
    if lanes:
        inbox.put("bye")
        polls.join(timeout=30)
    out = {"n": n, "devices": n * DEVICES, "seconds": round(wall, 1), "idle_lanes": lanes,
           # (a ship thread holds one connection at a time, of two pools: up to 2 × its threads are open)
           "connections": {**{k: threads[k] for k in KINDS}, EMPTY: threads["ship"]}, "points": ops.points,
           "points_per_s": ops.points / wall, "db_growth_bytes": size1 - size0, "db_size_bytes": size1,
           "pg_cpu_cores": {k: pg_cpu[k] / wall for k in (*KINDS, EMPTY, "api", "server")},
           "api_cpu_cores": api_cpu / wall,
           "bench_cpu_cores": bench_cpu / wall, "ops": {}}
    out["pg_cpu_cores"]["total"] = sum(v for k, v in pg_cpu.items() if k != "server") / wall
    for kind, res in results.items():
        offered, done = res["offered"], res["done"]
        lat = res["latencies"] or [math.nan]
        out["ops"][kind] = {
            "offered_per_s": offered / seconds, "achieved_per_s": done / wall,
            "achieved_ratio": done / offered if offered else math.nan,
            "p50_ms": percentile(lat, 0.5) * 1000, "p99_ms": percentile(lat, 0.99) * 1000,
            "lost": res["lost"], "errors": res["errors"],
            "pg_cpu_ms_per_op": pg_cpu[kind] * 1000 / done if done else math.nan,
            "client_cpu_ms_per_op": res["cpu_s"] * 1000 / done if done else math.nan}
    ship, empty = out["ops"]["ship"], ops.empty_ships
    full = results["ship"]["done"] - empty
    ship["pg_cpu_ms_per_op"] = (pg_cpu["ship"] + pg_cpu[EMPTY]) * 1000 / results["ship"]["done"] \
        if results["ship"]["done"] else math.nan
    ship["empty"] = {"share": empty / results["ship"]["done"] if results["ship"]["done"] else math.nan,
                     "pg_cpu_ms_per_op": pg_cpu[EMPTY] * 1000 / empty if empty else math.nan,
                     "p50_ms": percentile(ops.empty_latencies or [math.nan], 0.5) * 1000}
    ship["with_points_pg_cpu_ms_per_op"] = pg_cpu["ship"] * 1000 / full if full else math.nan
    out["ship_mix_per_job_s"] = real_ship_mix(settings, points_per_s)
    out["api_cpu_ms_per_read"] = read_costs(api, api_pid, idle_s=min(4.0, seconds / 3))
    for key, lat in api_reads.items():
        lat = lat or [math.nan]
        out[f"api_{key}"] = {"calls": len(api_reads[key]), "p50_ms": percentile(lat, 0.5) * 1000,
                             "p99_ms": percentile(lat, 0.99) * 1000}
    return out


def report_step(r: dict) -> None:
    print(f"  N={r['n']} workers ({r['devices']} running jobs), {r['seconds']} s; idle lanes {r['idle_lanes']}")
    for kind, o in r["ops"].items():
        print(f"    {kind:5}: offered {o['offered_per_s']:8.1f}/s achieved {o['achieved_per_s']:8.1f}/s "
              f"({o['achieved_ratio']:.2f}); p50 {o['p50_ms']:6.1f} ms p99 {o['p99_ms']:7.1f} ms; "
              f"PG {o['pg_cpu_ms_per_op']:.2f} ms/op, client {o['client_cpu_ms_per_op']:.2f} ms/op"
              + (f"; LOST {o['lost']}" if o["lost"] else "") + (f"; ERRORS {o['errors']}" if o["errors"] else ""))
    e = r["ops"]["ship"]["empty"]
    print(f"    ships with nothing new: {e['share']:.0%} of ships, PG {e['pg_cpu_ms_per_op']:.2f} ms each "
          f"(with points {r['ops']['ship']['with_points_pg_cpu_ms_per_op']:.2f} ms), p50 {e['p50_ms']:.1f} ms")
    pg = r["pg_cpu_cores"]
    print(f"    PostgreSQL CPU (cores): total {pg['total']:.2f} = " + ", ".join(
        f"{k} {pg[k]:.2f}" for k in (*KINDS, EMPTY, "api")) + f" (+ the server's own processes {pg['server']:.2f}); "
        f"API process {r['api_cpu_cores']:.2f}; bench client {r['bench_cpu_cores']:.2f}")
    print(f"    points stored {r['points_per_s']:.0f}/s; database +{r['db_growth_bytes'] / 2**20:.1f} MiB "
          f"({r['db_growth_bytes'] / max(1, r['points']):.0f} B a point, all writes counted) to "
          f"{r['db_size_bytes'] / 2**20:.0f} MiB")
    print(f"    API: GET /v1/workers p50 {r['api_workers']['p50_ms']:.1f} ms p99 {r['api_workers']['p99_ms']:.1f} ms; "
          f"GET /v1/jobs?status=running p50 {r['api_running']['p50_ms']:.1f} ms p99 "
          f"{r['api_running']['p99_ms']:.1f} ms ({r['api_workers']['calls']} calls each)")
    c = r["api_cpu_ms_per_read"]
    print(f"    the API's CPU, load stopped: a GET /v1/workers {c['workers']:.0f} ms "
          f"({c['workers_bytes'] / 1e3:.0f} kB), "
          f"a GET /v1/jobs?status=running {c['running']:.0f} ms ({c['running_bytes'] / 1e3:.0f} kB); its sweeper "
          f"{c['sweeper_cores']:.2f} cores", flush=True)


def real_ship_mix(settings: Settings, points_per_s: float) -> tuple[float, float]:
    """Ships a second of one job with points and with nothing new, at the real cadence: a ship every poll_s, a
    step of POINT_NAMES every len(POINT_NAMES) / points_per_s s, a usage sample every usage_sample_s."""
    ships = 1 / settings.poll_s
    with_step = min(1.0, points_per_s / len(POINT_NAMES) / ships)
    sampled = min(1.0, 1 / settings.usage_sample_s / ships) if settings.usage_sample_s else 0.0
    full = ships * (with_step + (1 - with_step) * sampled)
    return full, ships - full


def demand(r: dict) -> dict:
    """What the offered load of this N needs of PostgreSQL: cores (each kind's PG cost an op × its offered rate,
    ships at the real mix of those with points and with nothing new, the API's backends as measured), and
    connections as a real deployment opens them."""
    cores = sum(o["offered_per_s"] * o["pg_cpu_ms_per_op"] / 1000 for k, o in r["ops"].items()
                if k != "ship" and o["pg_cpu_ms_per_op"] > 0)
    ship, (full, empty) = r["ops"]["ship"], r["ship_mix_per_job_s"]
    costs = (ship["with_points_pg_cpu_ms_per_op"], ship["empty"]["pg_cpu_ms_per_op"])
    if not any(math.isnan(c) for c in costs):
        cores += r["devices"] * (full * costs[0] + empty * costs[1]) / 1000
    cores += r["pg_cpu_cores"]["api"]
    # At least: a worker process's heartbeat connection; each attempt's (worker/agent.py: an engine per job) two at
    # once, the supervisor's ship and the lease thread's renewal; the API's pool (up to 50). Not counted: each lane
    # process's own pooled connection (worker/main.py), kept while its job runs: up to 8 more a worker.
    return {"pg_cores_at_offered": cores, "connections_real": r["n"] + 2 * r["devices"] + 50}


def summarize(results: list[dict], max_connections: int) -> None:
    first, last = results[0], results[-1]
    cores = os.cpu_count() or 1
    print("\nSummary (ratios within this run; absolute figures are this machine's, shared; a ship's PG cost: one with "
          "points):")
    for r in results:
        d = demand(r)
        ship = r["ops"]["ship"]
        print(f"  N={r['n']:5}: ship p99 {ship['p99_ms']:.1f} ms; PG cores needed at the offered rate "
              f"{d['pg_cores_at_offered']:.1f} (this machine: {cores}); connections a real deployment opens "
              f"{d['connections_real']:,} (max_connections {max_connections}); API process "
              f"{r['api_cpu_cores']:.2f} cores; a snapshot + plan {r['ops']['poll']['client_cpu_ms_per_op']:.0f} ms "
              f"of Python CPU")
    if len(results) > 1:
        for kind in KINDS:
            a, b = first["ops"][kind], last["ops"][kind]
            pg = "pg_cpu_ms_per_op" if kind != "ship" else "with_points_pg_cpu_ms_per_op"  # (the mix varies)
            if a[pg] > 0 and b[pg] > 0:  # (NaN: not run)
                print(f"  {kind}: PG CPU a op at N={last['n']} / N={first['n']}: "
                      f"{b[pg] / a[pg]:.2f}; client CPU a op "
                      f"{b['client_cpu_ms_per_op'] / a['client_cpu_ms_per_op']:.2f}; "
                      f"p99 {b['p99_ms'] / a['p99_ms']:.2f}")
        per_worker = [demand(r)["pg_cores_at_offered"] / r["n"] for r in (first, last)]
        print(f"  PG cores a worker needs at the offered load, N={last['n']} / N={first['n']}: "
              f"{per_worker[1] / per_worker[0]:.2f} (x{last['n'] / first['n']:.0f} workers)")
        for key in ("api_workers", "api_running"):
            print(f"  {key} p50 at N={last['n']} / N={first['n']}: {last[key]['p50_ms'] / first[key]['p50_ms']:.1f}")
        a, b = first["api_cpu_ms_per_read"], last["api_cpu_ms_per_read"]
        for key in ("workers", "running", "sweeper_cores"):
            if a[key] > 0:
                print(f"  API CPU, {key}, at N={last['n']} / N={first['n']}: {b[key] / a[key]:.1f}")
    limits = [("PostgreSQL connections", lambda r: demand(r)["connections_real"] > max_connections),
              ("PostgreSQL CPU", lambda r: demand(r)["pg_cores_at_offered"] > cores)]
    for name, crossed in limits:
        at = next((r["n"] for r in results if crossed(r)), None)
        print(f"  {name}: " + (f"over this machine's limit from N={at}" if at else "within it at every N"))


def clean(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(delete(Job).where(Job.name == NAME))  # attempts, points, log chunks go with them
        conn.execute(delete(Hold).where(Hold.worker_id.like(f"{PREFIX}-w%")))
        conn.execute(delete(Worker).where(Worker.id.like(f"{PREFIX}-w%")))
    engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("TRAINJOBS_BENCH_POSTGRES_URL")
                        or "postgresql+psycopg://postgres@127.0.0.1:5432/bench_cp")
    parser.add_argument("--workers", default="100,250,500,1000", help="the steps of N, comma-separated")
    parser.add_argument("--seconds", type=float, default=25.0, help="the load's window at each N")
    parser.add_argument("--points-per-s", type=float, default=10.0, help="metric points a job reports a second")
    parser.add_argument("--idle-per-100", type=float, default=1.0, help="idle lanes polling, per 100 workers")
    parser.add_argument("--threads", default="beat=1,lease=3,ship=6,poll=1",
                        help="threads (each its own connection) per kind")
    parser.add_argument("--quick", action="store_true", help="a smoke run: N=20 for 3 s")
    parser.add_argument("--keep-schema", action="store_true",
                        help="migrate the database as it is (a shared test database: auth off, the bench's rows "
                        "deleted at the end) instead of a fresh schema")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.seconds = "20", 3.0
    steps = [int(x) for x in args.workers.split(",")]
    threads = {k: int(v) for k, v in (p.split("=") for p in args.threads.split(","))}
    os.environ.setdefault("TRAINJOBS_BENCH_REDIS_URL", default_redis_url())
    url, dbname = args.url, make_url(args.url).database
    started = time.monotonic()
    if args.keep_schema:
        migrate.upgrade(url)
        clean(url)
    else:
        fresh_schema(url)
    settings = Settings(database_url=url, lease_s=LEASE_S)
    print(f"PostgreSQL {url.rsplit('@', 1)[-1]}; one API process (its sweeper every {settings.sweep_s:g} s); "
          f"heartbeat {settings.heartbeat_s:g} s, ship every {settings.poll_s:g} s, {args.points_per_s:g} points/s a "
          f"job, usage samples every {settings.usage_sample_s:g} s; threads (= connections) {threads}", flush=True)
    results = []
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        max_connections = int(db.scalar(text("SHOW max_connections")))
    try:
        # A shared test database (--keep-schema) gets no admin of the bench's making: auth is off there.
        with bench_stack(workers=0, database_url=url, lease_s=LEASE_S, auth=not args.keep_schema) as (stack, _api):
            made_user = False
            if stack.settings.auth and stack.token is None:  # a database with an admin of its own (the tests')
                with sessions() as db:
                    made_user = db.get(User, "cpbench") is None
                    _row, stack.token = tokens.create(db, name=NAME, user="cpbench", role="admin")
                    db.commit()
            have = 0
            with stack.client(timeout=60) as api:
                for n in steps:
                    took = seed(sessions, have=have, n=n)
                    print(f"seeded {n} workers, {n * DEVICES} running jobs ({took:.1f} s)", flush=True)
                    have = n
                    results.append(run_step(url, dbname, sessions, api, stack, settings, n, seconds=args.seconds,
                                            threads=threads, points_per_s=args.points_per_s,
                                            idle_per_100=args.idle_per_100))
                    report_step(results[-1])
            if made_user:
                with sessions() as db:
                    db.execute(delete(ApiToken).where(ApiToken.name == NAME))
                    db.execute(delete(User).where(User.name == "cpbench"))
                    db.commit()
    finally:
        engine.dispose()
        if args.keep_schema:
            clean(url)
    summarize(results, max_connections)
    print(f"\nbench wall time {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"max_connections": max_connections, "steps": results,
                                         "demand": [demand(r) for r in results]}, indent=1, default=str))


if __name__ == "__main__":
    main()
