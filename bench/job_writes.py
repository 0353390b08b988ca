"""What a job's writes cost the service (issue 37): metric ingest on PostgreSQL, and the worker's memory under an
output flood, with and without a stalled database, before and after the bounds.

1. Ingest: 1 and 8 jobs at once, each shipping 200,000 points (4 names) through the supervisor's MetricTail in
   its bounded batches (commit after commit, no poll wait: the most the database takes), points/s in all.
2. Memory: a real stack on PostgreSQL runs a job that prints as fast as it can for --flood-s seconds; the worker's
   own processes (the worker and its work-horse, not the job's ranks) are sampled every 0.2 s: peak PSS (shared
   pages split between them) and RSS. Once plain, once with every backend of the stack's database stopped
   (SIGSTOP) for --stall-s seconds. Each on --before (a git revision, run from a worktree of it) and on this tree.

    python bench/job_writes.py [--before 6329f83] [--flood-s 10] [--stall-s 8] [--points 200000]
"""

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TREE = Path(os.environ.get("TRAINJOBS_BENCH_TREE") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(TREE))

import psutil  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
PRINT_FOR = """\
import os, sys, time
end = time.time() + float(os.environ["PRINT_S"])
block = ("w" * 200 + "\\n") * 100
while time.time() < end:
    sys.stdout.write(block)
print("done printing", flush=True)
"""


def postgres_url() -> str:
    return (os.environ.get("TRAINJOBS_BENCH_POSTGRES_URL") or os.environ.get("TRAINJOBS_TEST_POSTGRES_URL")
            or "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def redis_url() -> str:
    for name in ("TRAINJOBS_BENCH_REDIS_URL", "TRAINJOBS_TEST_REDIS_URL", "TRAINJOBS_REDIS_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return "redis://127.0.0.1:6379/14"


def fresh_database(name: str) -> str:
    """An empty PostgreSQL database `name` on the bench's server; its URL."""
    url = make_url(postgres_url())
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


# --- 1. ingest ---------------------------------------------------------------------------------------------------

def ship_one(args: tuple[str, int, str]) -> tuple[int, float]:
    """One job's points, shipped in the supervisor's batches; (points stored, seconds)."""
    url, points, folder = args
    from service.db import make_engine, make_sessionmaker
    from service.jobs import service as jobs
    from service.settings import Settings
    from trainjobs.spec import JobSpec
    from worker.shipping import MetricCaps, MetricTail

    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    spec = JobSpec.model_validate({"name": "ingest", "model": {"type": "mlp", "hidden": [8]},
                                   "data": {"type": "synthetic_regression"}})
    with sessions() as db:
        job_id = jobs.create(db, spec=spec).id
        db.commit()
    path = Path(folder) / f"{job_id}.jsonl"
    now = time.time()
    with open(path, "w") as f:
        for step in range(points // 4):
            f.write(json.dumps({"type": "metrics", "step": step, "time": now,
                                "metrics": {"loss": 1.0 / (step + 1), "lr": 1e-3, "grad_norm": 0.5, "tokens": step}})
                    + "\n")
    caps = MetricCaps.of(Settings(metric_max_points=10 * points))
    tail, stored = MetricTail(path, caps), 0
    started = time.perf_counter()
    while True:
        with sessions() as db:
            stored += tail.write(db, job_id=job_id, attempt=1)
            db.commit()
        tail.committed()
        if not tail.more:
            break
    took = time.perf_counter() - started
    engine.dispose()
    return stored, took


def ingest(points: int) -> dict:
    from service import migrate

    url = fresh_database("bench_ingest")
    migrate.upgrade(url)
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for jobs in (1, 8):
            started = time.perf_counter()
            with multiprocessing.get_context("spawn").Pool(jobs) as pool:
                results = pool.map(ship_one, [(url, points, folder)] * jobs)
            wall = time.perf_counter() - started
            stored = sum(n for n, _ in results)
            found[jobs] = {"points": stored, "wall_s": round(wall, 2), "points_per_s": round(stored / wall)}
            print(f"ingest, {jobs} job(s) at once: {stored:,} points in {wall:.1f}s = {stored / wall:,.0f} points/s"
                  f" (per ship: {json.dumps([round(t, 2) for _, t in results])} s per job)", flush=True)
    return found


# --- 2. memory (run inside the tree measured: TRAINJOBS_BENCH_TREE) ------------------------------------------------

def worker_memory(stack) -> tuple[int, int]:
    """(PSS, RSS) of the worker's own processes: every worker and its direct children but the job's launcher."""
    pss = rss = 0
    for name, proc in stack.procs:
        if not name.startswith("worker"):
            continue
        try:
            me = psutil.Process(proc.pid)
            procs = [me, *me.children()]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
                if p.name() in ("bwrap", "setpriv") or "torch.distributed.run" in cmd:
                    continue
                info = p.memory_full_info()
                pss, rss = pss + info.pss, rss + info.rss
            except psutil.NoSuchProcess:
                pass
    return pss, rss


def memory_case(database_url: str, *, flood_s: float, stall_s: float) -> dict:
    from service import migrate
    from service.cli.stack import Stack
    from service.settings import Settings

    migrate.upgrade(database_url)
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-") as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=database_url, redis_url=redis_url(),
                            queue_prefix=f"benchw{os.getpid()}", allow_entrypoints=True)
        (settings.data_dir / "scripts").mkdir(parents=True)
        (settings.data_dir / "scripts" / "print_for.py").write_text(PRINT_FOR)
        with Stack(settings, port=free_port(), workers=1, quiet=True) as stack, stack.client(timeout=60) as api:
            job_id = api.post("/v1/jobs", json={"name": "flood", "resources": {"nproc_per_node": 1},
                                                "entrypoint": {"script": "print_for.py"},
                                                "env": {"PRINT_S": str(flood_s)}}).json()["id"]
            while api.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
                time.sleep(0.2)
            peak_pss = peak_rss = 0
            stopped: list[int] = []
            started = time.monotonic()
            stall_at = started + 2 if stall_s else None
            while True:
                now = time.monotonic()
                if stall_at is not None and now >= stall_at and not stopped:
                    stopped = backends(database_url)
                    for pid in stopped:
                        os.kill(pid, signal.SIGSTOP)
                if stopped and now >= stall_at + stall_s:
                    resume(stopped)
                    stopped, stall_at = [], None
                pss, rss = worker_memory(stack)
                peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
                if not stopped and now - started > flood_s + 1:
                    try:
                        job = api.get(f"/v1/jobs/{job_id}").json()
                    except Exception:  # noqa: BLE001 - the API's own database was stalled: ask again
                        job = {"status": "?"}
                    if job["status"] in ("succeeded", "failed", "cancelled"):
                        break
                time.sleep(0.2)
            logged = len(api.get(f"/v1/jobs/{job_id}/logs").content)
            attempts = len(api.get(f"/v1/jobs/{job_id}/attempts").json()["data"])
    error = (job.get("error") or {}).get("type")
    return {"peak_pss_mb": round(peak_pss / 2**20), "peak_rss_mb": round(peak_rss / 2**20),
            "status": job["status"], "error": error, "attempts": attempts, "log_bytes": logged}


def backends(database_url: str) -> list[int]:
    engine = create_engine(database_url)
    with engine.connect() as conn:
        pids = list(conn.scalars(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                      "AND pid <> pg_backend_pid()")))
    engine.dispose()
    return pids


def resume(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_tree(tree: Path, label: str, *, flood_s: float, stall_s: float) -> dict:
    """Both memory cases on `tree`'s code, each in a child process that imports only that tree."""
    found = {}
    for case, stall in (("flood", 0.0), ("flood + stall", stall_s)):
        url = fresh_database(f"bench_writes_{label}")
        env = {**os.environ, "TRAINJOBS_BENCH_TREE": str(tree), "PYTHONPATH": str(tree)}
        out = subprocess.run([sys.executable, str(HERE / "bench" / "job_writes.py"), "--memory-case", url,
                              "--flood-s", str(flood_s), "--stall-s", str(stall)],
                             cwd=tree, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"{label} {case}: {out.stderr[-3000:]}")
        found[case] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"memory, {label}, {case}: {json.dumps(found[case])}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="6329f83", help="the revision to compare with ('' for none)")
    parser.add_argument("--flood-s", type=float, default=10.0)
    parser.add_argument("--stall-s", type=float, default=8.0)
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)  # a child's: the database URL
    args = parser.parse_args()
    if args.memory_case:
        print(json.dumps(memory_case(args.memory_case, flood_s=args.flood_s, stall_s=args.stall_s)))
        return
    results = {"ingest": ingest(args.points)}
    trees = [("after", HERE)]
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="trainjobs-before-"))
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True)
        trees.insert(0, ("before", worktree))
    try:
        for label, tree in trees:
            results[label] = measure_tree(tree, label, flood_s=args.flood_s, stall_s=args.stall_s)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(worktree)], check=False)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
