"""What a job's writes cost the service (issues 37 and 42): metric ingest on PostgreSQL, what a ship with nothing
new costs the database, and the worker's memory under an output flood, with and without a stalled database, before
and after.

1. Ingest: 1 and 8 jobs at once, each shipping 200,000 points (4 names) through the supervisor's MetricTail in
   its bounded batches (commit after commit, no poll wait: the most the database takes), points/s in all.
2. Idle ship: a running attempt's supervisor ships 20 times with nothing new (after one ship with points and
   output): the statements, commits and UPDATEs each costs the database (counted on the engine), and whether the
   job's version (its ETag) moved. Then 200 busy ships (a step of 10 series and a line of output each): the
   same counts and the database backends' CPU a ship.
3. Memory: a real stack on PostgreSQL runs a job that prints as fast as it can for --flood-s seconds; the worker's
   own processes (the worker and its work-horse, not the job's ranks) are sampled every 0.2 s: peak PSS (shared
   pages split between them) and RSS. Once plain, once with every backend of the stack's database stopped
   (SIGSTOP) for --stall-s seconds.
Each case runs on --before (a git revision, from a worktree of it) and on this tree, in child processes that
import only the tree they measure.

    python bench/job_writes.py [--before 1a9a2f0] [--cases ingest,idle,memory] [--flood-s 10] [--stall-s 8]
                               [--points 200000]
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

START: list = []  # a pool process's barrier: every job starts shipping at once, once all are ready


def ready(barrier) -> None:
    START.append(barrier)


def ship_one(args: tuple[str, int, str]) -> tuple[int, float, float, float]:
    """One job's points, shipped in the supervisor's batches; (points stored, seconds, its start and end)."""
    url, points, folder = args
    from service.db import make_engine, make_sessionmaker
    from service.jobs import service as jobs
    from service.metrics import service as metrics
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
    with sessions() as db:  # the connection made before the clock starts (the pool keeps it: one backend)
        backend = db.scalar(text("SELECT pg_backend_pid()"))
    START[0].wait()
    started, began = time.perf_counter(), time.time()
    cpu, db_cpu = time.process_time(), cpu_s(backend)
    while True:
        with sessions() as db:
            stored += metrics.insert_shipped(db, job_id=job_id, attempt=1, points=tail.part())
            db.commit()
        tail.committed()
        if not tail.more:
            break
    took, ended = time.perf_counter() - started, time.time()
    cpu, db_cpu = time.process_time() - cpu, cpu_s(backend) - db_cpu
    engine.dispose()
    return stored, took, began, ended, cpu, db_cpu


def cpu_s(pid: int) -> float:
    """CPU-seconds a process (here: the job's database backend, on this machine) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ingest(points: int, jobs: int) -> dict:
    """`jobs` jobs shipping `points` each at once, into a fresh database (run inside the tree measured)."""
    from service import migrate

    url = fresh_database(f"bench_ingest_{os.getpid()}")
    migrate.upgrade(url)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder, context.Pool(jobs, ready, (context.Barrier(jobs),)) as pool:
        results = pool.map(ship_one, [(url, points, folder)] * jobs)
    wall = max(r[3] for r in results) - min(r[2] for r in results)  # from the first start to the last end
    stored = sum(r[0] for r in results)
    worker_us, db_us = (round(sum(r[i] for r in results) / stored * 1e6, 1) for i in (4, 5))
    drop_database(url)
    return {"points": stored, "wall_s": round(wall, 2), "points_per_s": round(stored / wall),
            "per_job_s": [round(r[1], 2) for r in results], "worker_cpu_us_per_point": worker_us,
            "db_cpu_us_per_point": db_us}


def idle_ship(ships: int = 20, busy: int = 200) -> dict:
    """What a ship with nothing new costs the database: statements, commits and UPDATEs per ship, and how many
    times the job's version (its ETag) moved; then the same and the database's CPU for a busy ship (one step of
    10 series, a line of output). Run inside the tree measured. NOTE: the engine does not see a COPY."""
    from sqlalchemy import event, select

    from service import migrate
    from service.db import make_engine, make_sessionmaker, utcnow
    from service.jobs import lifecycle
    from service.jobs import service as jobs
    from service.jobs.models import Attempt, Job
    from service.settings import Settings
    from trainjobs.spec import JobSpec
    from trainjobs.states import JobStatus
    from worker.supervisor import Supervisor

    url = fresh_database(f"bench_idle_{os.getpid()}")
    migrate.upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    spec = JobSpec.model_validate({"name": "idle", "model": {"type": "mlp", "hidden": [8]},
                                   "data": {"type": "synthetic_regression"}, "train": {"max_steps": 1000}})
    with sessions() as db:
        job_id = jobs.create(db, spec=spec).id
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.STARTING,
                                    values={"attempt": 1, "started_at": utcnow()})
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=1)
        db.add(Attempt(job_id=job_id, number=1, worker="w0", node_rank=0, started_at=utcnow(),
                       lease_expires_at=lifecycle.lease_until(db, 600)))
        db.commit()

    class Output:  # the ranks' output: some once, then nothing
        data = b"step 1\n"

        def take(self) -> bytes:
            data, self.data = self.data, b""
            return data

    with tempfile.TemporaryDirectory() as run_dir:
        sup = Supervisor(sessions=sessions, settings=Settings(database_url=url), job_id=job_id, attempt=1,
                         spec=spec, run_dir=Path(run_dir))
        sup.shipper.open(max_bytes=1 << 20)
        with open(Path(run_dir) / "metrics.jsonl", "w") as f:
            for step in range(1, 6):
                f.write(json.dumps({"type": "metrics", "step": step, "time": time.time(),
                                    "metrics": {"loss": 1.0 / step, "step_time_s": 0.1}}) + "\n")
        output = Output()
        sup._ship(output)  # the points and the output: stored
        counted = {"statements": 0, "updates": 0, "commits": 0}

        def statement(conn, cursor, sql, *args):
            counted["statements"] += 1
            counted["updates"] += sql.lstrip().upper().startswith("UPDATE")

        def commit(conn):
            counted["commits"] += 1

        version = select(Job.version).where(Job.id == job_id)
        with sessions() as db:
            before = db.scalar(version)
        event.listen(engine, "before_cursor_execute", statement)
        event.listen(engine, "commit", commit)
        for _ in range(ships):
            sup._ship(output)
        idle = {f"{k}_per_ship": counted[k] / ships for k in counted}
        with sessions() as db:
            after = db.scalar(version)
        # A busy ship as a running job's usually is: one new step of 10 series and a line of output.
        counted.update(statements=0, updates=0, commits=0)
        names = [f"series_{i}" for i in range(10)]
        db_cpu = backends_cpu(sessions)
        for step in range(6, 6 + busy):
            with open(Path(run_dir) / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"type": "metrics", "step": step, "time": time.time(),
                                    "metrics": dict.fromkeys(names, 0.5)}) + "\n")
            output.data = f"step {step}\n".encode()
            sup._ship(output)
        db_cpu = backends_cpu(sessions) - db_cpu
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "commit", commit)
    engine.dispose()
    drop_database(url)
    return {**idle, "version_moves": after - before, "ships": ships,
            "busy": {**{f"{k}_per_ship": counted[k] / busy for k in counted},
                     "db_cpu_us_per_ship": round(db_cpu / busy * 1e6), "ships": busy}}


def backends_cpu(sessions) -> float:
    """CPU-seconds used so far by every backend of the session's database (the bench's own, on this machine)."""
    with sessions() as db:
        pids = db.scalars(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")).all()
    return sum(cpu_s(pid) for pid in pids)


def drop_database(url: str) -> None:
    admin = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def in_tree(tree: Path, *args: str) -> dict:
    """This script's `args` case run in a child process that imports only `tree`'s code; its JSON answer."""
    env = {**os.environ, "TRAINJOBS_BENCH_TREE": str(tree), "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(HERE / "bench" / "job_writes.py"), *args], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{tree} {args}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        found[case] = in_tree(tree, "--memory-case", url, "--flood-s", str(flood_s), "--stall-s", str(stall))
        print(f"memory, {label}, {case}: {json.dumps(found[case])}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="1a9a2f0", help="the revision to compare with ('' for none)")
    parser.add_argument("--cases", default="ingest,idle,memory")
    parser.add_argument("--flood-s", type=float, default=10.0)
    parser.add_argument("--stall-s", type=float, default=8.0)
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--memory-case", help=argparse.SUPPRESS)  # a child's: the database URL
    parser.add_argument("--ingest-case", type=int, help=argparse.SUPPRESS)  # a child's: how many jobs at once
    parser.add_argument("--idle-case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_case:
        print(json.dumps(memory_case(args.memory_case, flood_s=args.flood_s, stall_s=args.stall_s)))
        return
    if args.ingest_case:
        print(json.dumps(ingest(args.points, args.ingest_case)))
        return
    if args.idle_case:
        print(json.dumps(idle_ship()))
        return
    cases = args.cases.split(",")
    trees = [("after", HERE)]
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="trainjobs-before-"))
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True)
        trees.insert(0, ("before", worktree))
    results: dict = {label: {} for label, _ in trees}
    try:
        if "ingest" in cases:
            for jobs in (1, 8):
                for label, tree in trees:
                    found = results[label][f"ingest, {jobs} job(s)"] = in_tree(
                        tree, "--ingest-case", str(jobs), "--points", str(args.points))
                    print(f"ingest, {label}, {jobs} job(s) at once: {found['points']:,} points in "
                          f"{found['wall_s']:.1f}s = {found['points_per_s']:,} points/s "
                          f"(per job: {found['per_job_s']} s; CPU per point: shipping "
                          f"{found['worker_cpu_us_per_point']} µs, database {found['db_cpu_us_per_point']} µs)",
                          flush=True)
        if "idle" in cases:
            for label, tree in trees:
                found = results[label]["idle ship"] = in_tree(tree, "--idle-case")
                print(f"idle ship, {label}: {json.dumps(found)}", flush=True)
        if "memory" in cases:
            for label, tree in trees:
                results[label] |= measure_tree(tree, label, flood_s=args.flood_s, stall_s=args.stall_s)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(worktree)], check=False)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
