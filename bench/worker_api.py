"""The worker protocol at scale (issue 42): simulated workers × 8 devices driving the API's /v1/worker/ calls, as
workers that hold no database URL do, against PostgreSQL behind one or more API processes.

The "after" of bench/control_plane.py (whose workers are database clients): the same seed (N workers, 8N jobs
`running`, each with its attempt and device hold, `bench.control_plane.seed`), each worker a runner with its own
credential, and the same cadence a real worker keeps, over HTTP with one keep-alive connection per client thread.
A worker-tick (poll_s, 0.5 s) of a worker running 8 jobs whose ranks report a step a second: 4 batches (the other 4
jobs have nothing new this tick, and a ship with nothing new sends nothing), each with 10 metric points, a log
line, the changed progress and a sequence number; every heartbeat_s (2 s, a quarter of the ticks) its heartbeat and
all 8 leases. One batch in ten is sent again as it was (a retry after a lost answer): acknowledged, applied once.
`--mode` says how the worker sends a tick:

- `calls`: a `ship` call per batch, and every heartbeat_s a `heartbeat` and a `leases` call (8 renewals);
- `tick`: one `tick` call carrying all of it (service/runners/tick_calls.py); a retry sends the tick again.

One Python process cannot offer 1,000 workers' load on 2 cores; as in bench/control_plane.py the figure that
scales is each kind of call's CPU (the API processes' and their PostgreSQL backends', from /proc) per call, times
its offered rate. Connections are counted in pg_stat_activity during the window: the API processes' pools alone.

    TRAINJOBS_BENCH_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/bench_wapi \\
    TRAINJOBS_BENCH_REDIS_URL=redis://127.0.0.1:6379/7 .venv/bin/python bench/worker_api.py \\
        [--mode calls|tick] [--quick]
"""

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import text, update

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, percentile  # noqa: E402
from bench.control_plane import DEVICES, cpu_s, fresh_schema, job_id, seed, worker_id  # noqa: E402
from service.cli.stack import Stack  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.runners import credentials  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.workers.models import Worker  # noqa: E402

NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb", "acc", "ppl", "loss_ema", "throughput")
KINDS = ("ship", "heartbeat", "leases", "tick")
REPLAY_EVERY = 10  # one batch in ten sent twice


def make_runners(sessions, *, have: int, n: int, into: dict[int, str]) -> None:
    """A credential for each simulated worker have..n-1 (runner = its worker id), as a join would give it."""
    with sessions() as db:
        _, token = credentials.create_join_token(db, created_by="bench", expires_at=None, uses=None)
        for w in range(have, n):
            _, secret = credentials.join(db, secret=token, runner=worker_id(w))
            into[w] = secret
        db.execute(update(Worker).where(Worker.id.in_([worker_id(w) for w in range(have, n)]))
                   .values(runner=Worker.id))  # registered by its runner, as a joined worker registers
        db.commit()


class Job:
    __slots__ = ("id", "seq", "log_at", "log_seq", "step")

    def __init__(self, jid: str):
        self.id, self.seq, self.log_at, self.log_seq, self.step = jid, 0, 0, 0, 0

    def batch(self, now: float) -> dict:
        """The next batch: a second of steps (10 points), a log line, the progress."""
        self.seq, self.log_seq, self.step = self.seq + 1, self.log_seq + 1, self.step + 1
        line = f"step {self.step} loss {1.0 / self.step:.4f}\n"
        body = {"job_id": self.id, "attempt": 1, "node_rank": 0, "seq": self.seq,
                "log": {"start": self.log_at, "seq": self.log_seq, "text": line},
                "points": [[self.step, name, random.random(), now] for name in NAMES],
                "progress": {"step": self.step, "total_steps": 10_000_000, "eta_s": 1000.0}}
        self.log_at += len(line.encode())
        return body


class Drive:
    """Client threads working through the workers' ticks in the real mix, as fast as they go."""

    def __init__(self, api_url: str, secrets: dict[int, str], n: int, seconds: float, mode: str,
                 jobs: dict[int, list[Job]]):
        self.api_url, self.secrets, self.n, self.deadline = api_url, secrets, n, time.monotonic() + seconds
        self.mode = mode
        for w in range(n):  # kept from step to step: a job's next batch has the next sequence number
            jobs.setdefault(w, [Job(job_id(w, d)) for d in range(DEVICES)])
        self.jobs = jobs
        self.lat: dict[str, list[float]] = {k: [] for k in KINDS}
        self.calls = {k: 0 for k in KINDS} | {"replay": 0, "errors": 0, "ticks": 0, "batches": 0}
        self.lock = threading.Lock()
        self.next_worker = 0
        self.ticked: dict[int, int] = {}  # each worker's ticks so far
        self.again: dict[int, list[dict]] = {}  # each worker's batches to send again (tick mode)

    def take(self) -> int | None:
        with self.lock:
            if time.monotonic() >= self.deadline:
                return None
            w, self.next_worker = self.next_worker, (self.next_worker + 1) % self.n
            self.calls["ticks"] += 1
            return w

    def replay_due(self) -> bool:
        with self.lock:
            self.calls["batches"] += 1
            return self.calls["batches"] % REPLAY_EVERY == 0

    def run(self) -> None:
        with httpx.Client(base_url=self.api_url, timeout=60) as client:
            while (w := self.take()) is not None:
                self.tick(client, w)

    def tick(self, client: httpx.Client, w: int) -> None:
        headers = {"Authorization": f"Bearer {self.secrets[w]}"}
        jobs, now = self.jobs[w], time.time()
        with self.lock:
            number = self.ticked[w] = self.ticked.get(w, 0) + 1  # this worker's own tick
            again, self.again[w] = self.again.get(w, []), []
        half = jobs[::2] if number % 2 else jobs[1::2]  # 4 of 8 have a new step this tick
        batches = [job.batch(now) for job in half]
        beat = number % 4 == w % 4  # every heartbeat_s: a quarter of its ticks
        refs = [{"job_id": j.id, "attempt": 1, "node_rank": 0} for j in jobs]
        replays = [body for body in batches if self.replay_due()]
        if self.mode == "tick":  # a batch whose answer was lost goes again in the worker's next tick
            body = {"heartbeat": {"worker_id": worker_id(w)} if beat else None, "leases": refs if beat else [],
                    "ships": again + batches, "events": []}
            self.post(client, "tick", body, headers, again=len(again))
            with self.lock:
                self.again[w] = replays
            return
        for body in batches:
            self.post(client, "ship", body, headers)
            if any(body is replay for replay in replays):
                self.post(client, "ship", body, headers, again=1)
        if beat:
            self.post(client, "heartbeat", {"worker_id": worker_id(w)}, headers)
            self.post(client, "leases", {"attempts": refs}, headers)

    def post(self, client: httpx.Client, call: str, body: dict, headers: dict, again: int = 0) -> None:
        """The call; of the batches it carries, the first `again` were sent before (acknowledged, not applied)."""
        t = time.perf_counter()
        r = client.post(f"/v1/worker/{call}", json=body, headers=headers)
        took = time.perf_counter() - t
        with self.lock:
            if r.status_code >= 400:
                self.calls["errors"] += 1
                if self.calls["errors"] <= 3:
                    print(f"  {call}: HTTP {r.status_code} {r.text[:300]}", file=sys.stderr)
                return
            acks = r.json()["ships"] if call == "tick" else [r.json()] if call == "ship" else []
            assert [ack["applied"] for ack in acks] == [i >= again for i in range(len(acks))], r.text
            self.calls["replay"] += again
            if call != "ship" or not again:
                self.calls[call] += 1
                self.lat[call].append(took)


def backends(monitor, dbname: str) -> list[int]:
    with monitor() as db:
        return [pid for (pid,) in db.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = :d AND "
                                                  "backend_type = 'client backend' AND pid <> pg_backend_pid()"),
                                             {"d": dbname})]


def api_pids(stack: Stack) -> list[int]:
    import psutil

    out = []
    for name, proc in stack.procs:
        if name == "api":
            top = psutil.Process(proc.pid)
            out += [top.pid, *(c.pid for c in top.children(recursive=True))]
    return out


def run_step(stack: Stack, monitor, dbname: str, secrets: dict[int, str], n: int, *, seconds: float,
             threads: int, mode: str, jobs: dict[int, list[Job]]) -> dict:
    drive = Drive(stack.api_url, secrets, n, seconds, mode, jobs)
    pg0 = {pid: cpu_s(pid) for pid in backends(monitor, dbname)}
    apis = api_pids(stack)
    api0, t0 = sum(cpu_s(p) for p in apis), time.monotonic()
    connections: list[int] = []
    pool = [threading.Thread(target=drive.run, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    while any(t.is_alive() for t in pool):
        connections.append(len(backends(monitor, dbname)))
        time.sleep(1.0)
    wall = time.monotonic() - t0
    pg1 = backends(monitor, dbname)
    pg = sum(max(0.0, cpu_s(pid) - pg0.get(pid, 0.0)) for pid in set(pg0) | set(pg1))
    api = sum(cpu_s(p) for p in apis) - api0
    ticks = drive.calls["ticks"]
    ship = drive.lat["tick" if mode == "tick" else "ship"] or [float("nan")]  # the request that carried a batch
    return {"mode": mode, "n": n, "seconds": round(wall, 1), "worker_ticks": ticks, "calls": drive.calls,
            "pg_connections_max": max(connections or [0]),
            "pg_cpu_ms_per_worker_tick": pg * 1000 / ticks if ticks else None,
            "api_cpu_ms_per_worker_tick": api * 1000 / ticks if ticks else None,
            "ship_p50_ms": percentile(ship, 0.5) * 1000, "ship_p99_ms": percentile(ship, 0.99) * 1000,
            # At the real cadence each worker makes 2 worker-ticks a second: the cores its load would need.
            "pg_cores_at_offered": pg / ticks * 2 * n if ticks else None,
            "api_cores_at_offered": api / ticks * 2 * n if ticks else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("calls", "tick"), default="calls",
                        help="a call per batch and per heartbeat_s, or one tick call per worker-tick")
    parser.add_argument("--ns", default="100,250,500,1000")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (uvicorn --workers)")
    parser.add_argument("--quick", action="store_true", help="N=10 and 20 for 3 s each (the test's mode)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    ns = [10, 20] if args.quick else [int(x) for x in args.ns.split(",")]
    seconds = 3.0 if args.quick else args.seconds
    from bench.common import postgres_url, redis_url

    url = postgres_url()
    dbname = url.rsplit("/", 1)[1].split("?")[0]
    fresh_schema(url)
    import tempfile

    data = Path(tempfile.mkdtemp(prefix="bench-wapi-"))
    settings = Settings(database_url=url, redis_url=redis_url(), data_dir=data, auth=True, lease_s=3600.0,
                        queue_prefix=f"wapi{free_port()}")
    engine = make_engine(url)
    monitor = sessions = make_sessionmaker(engine)
    secrets: dict[int, str] = {}
    jobs: dict[int, list[Job]] = {}
    results = []
    with Stack(settings, port=free_port(), workers=0, quiet=True, api_workers=args.api_workers) as stack:
        have = 0
        for n in ns:
            seed(sessions, have=have, n=n)
            make_runners(sessions, have=have, n=n, into=secrets)
            have = n
            r = run_step(stack, monitor, dbname, secrets, n, seconds=seconds, threads=args.threads, mode=args.mode,
                         jobs=jobs)
            results.append(r)
            print(f"{args.mode} N={n}: {r['worker_ticks']} worker-ticks in {r['seconds']} s; "
                  f"PG connections {r['pg_connections_max']}; "
                  f"PG {r['pg_cpu_ms_per_worker_tick']:.2f} ms, API {r['api_cpu_ms_per_worker_tick']:.2f} ms "
                  f"CPU per worker-tick; ship (the request carrying a batch) p50 {r['ship_p50_ms']:.1f} / p99 "
                  f"{r['ship_p99_ms']:.1f} ms; "
                  f"at the offered load PG {r['pg_cores_at_offered']:.2f} cores, "
                  f"API {r['api_cores_at_offered']:.2f} cores; calls {r['calls']}", flush=True)
    engine.dispose()
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(f"N={last['n']} ÷ N={first['n']}: PG CPU per worker-tick "
              f"{last['pg_cpu_ms_per_worker_tick'] / first['pg_cpu_ms_per_worker_tick']:.2f}, API CPU per "
              f"worker-tick {last['api_cpu_ms_per_worker_tick'] / first['api_cpu_ms_per_worker_tick']:.2f}, "
              f"PG connections {last['pg_connections_max'] / max(1, first['pg_connections_max']):.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
