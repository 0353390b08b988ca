"""What the sandbox costs (worker/sandbox.py): its start per attempt, and the training step inside it vs. outside.

1. Start: the attempt's sandbox made and entered (its cgroup, its folders handed to the job's uid, bwrap's
   namespaces and mounts, setpriv) around /bin/true, minus /bin/true started plainly; rounds alternate (goal
   <= 100 ms).
   The attempt starts from another job's model.pt (init_from), lent by descriptor as every attempt's is.
2. Step time: the built-in runtime on the same spec under the worker's torchrun command line, bare and
   sandboxed, alternating (B A A B ...), samples/s each (goal: sandboxed / bare >= 0.99).
3. File handling (issue 41): the supervisor's read of a job's metrics file, through service/jobfiles.py (openat2,
   fstat, checks) vs. a plain open() as before, alternating; its share of one core at the ship cadence.

    python bench/sandbox.py [--start-rounds 40] [--pairs 3] [--read-rounds 20000]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import SPEC as THROUGHPUT_SPEC  # noqa: E402
from service import jobfiles  # noqa: E402
from service.settings import Settings  # noqa: E402
from trainjobs import runenv  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402
from worker import launch, sandbox  # noqa: E402

JOB_ID, SOURCE_ID = "0123456789abcdef0123", "3210fedcba9876543210"
SPEC = {**THROUGHPUT_SPEC, "name": "bench-sandbox"}  # the same job the service-overhead bench runs


def attempt_dirs(root: Path, n: int) -> tuple[Settings, sandbox.Attempt]:
    settings = Settings(data_dir=root / "data")
    run_dir = root / "data" / "runs" / JOB_ID / f"attempt-{n}"
    job_dir = root / "data" / "storage" / "jobs" / JOB_ID
    source = root / "data" / "storage" / "jobs" / SOURCE_ID / "artifacts" / "model.pt"
    for d in (run_dir / "tmp", job_dir / "checkpoints", job_dir / "artifacts", source.parent):
        d.mkdir(parents=True, exist_ok=True)
    source.write_bytes(b"weights")
    (run_dir / runenv.SPEC_FILE).write_text(JobSpec.model_validate(SPEC).model_dump_json())
    return settings, sandbox.Attempt(job_id=JOB_ID, run_dir=run_dir, job_dir=job_dir, python=sys.executable,
                                     data_dir=settings.data_dir, scripts_dir=root / "data" / "scripts",
                                     init_from=source, init_job=SOURCE_ID)


def start_round(root: Path, n: int, support: sandbox.Support, boxed: bool) -> float:
    settings, attempt = attempt_dirs(root, n)
    t0 = time.perf_counter()
    if boxed:
        box = sandbox.Box(support, settings, attempt, memory_bytes=sandbox.default_memory_bytes())
        argv, env = box.wrap(["/bin/true"], {"PATH": "/usr/bin:/bin"})
        subprocess.run(argv, env=env, check=True, preexec_fn=box.preexec, pass_fds=box.pass_fds)
        box.close()
    else:
        subprocess.run(["/bin/true"], env={"PATH": "/usr/bin:/bin"}, check=True)
    return time.perf_counter() - t0


def train_round(root: Path, n: int, support: sandbox.Support, boxed: bool) -> float:
    settings, attempt = attempt_dirs(root, n)
    attempt = replace(attempt, init_from=None, init_job=None)  # the runtime would load it
    plan = launch.render(JobSpec.model_validate(SPEC), job_id=JOB_ID, attempt=n, run_dir=attempt.run_dir,
                         python=sys.executable, data_dir=settings.data_dir, job_dir=attempt.job_dir,
                         shutdown_grace_s=5, base_env=sandbox.job_env(settings), cpu_count=os.cpu_count() or 1)
    argv, env, preexec, box = plan.argv, plan.env, None, None
    if boxed:
        box = sandbox.Box(support, settings, attempt, memory_bytes=sandbox.default_memory_bytes())
        argv, env = box.wrap(argv, env)
        preexec = box.preexec
    done = subprocess.run(argv, env=env, cwd=attempt.run_dir, capture_output=True, text=True, preexec_fn=preexec,
                          umask=box.umask if box else -1, pass_fds=box.pass_fds if box else ())
    if box:
        box.close()
    if done.returncode != 0:
        raise RuntimeError(f"{'sandboxed' if boxed else 'bare'} run exited {done.returncode}:\n{done.stdout[-3000:]}")
    records = [json.loads(line) for line in (attempt.run_dir / runenv.METRICS_FILE).read_text().splitlines()]
    return next(r["summary"] for r in records if r["type"] == "summary")["samples_per_s"]


def read_rounds(root: Path, rounds: int) -> tuple[float, float]:
    """Microseconds per read of a 1,000-line metrics file: through jobfiles, and by a plain open (the old way)."""
    run_dir = root / "reads"
    run_dir.mkdir()
    line = json.dumps({"type": "metrics", "step": 1, "time": 1.7e9, "metrics": {"loss": 0.5}}) + "\n"
    (run_dir / runenv.METRICS_FILE).write_text(line * 1000)
    checked, plain = [], []
    for i in range(rounds):
        for safe in ((True, False) if i % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            if safe:
                jobfiles.read_bytes(run_dir, runenv.METRICS_FILE, limit=1 << 20, offset=len(line) * 990)
            else:
                with open(run_dir / runenv.METRICS_FILE, "rb") as f:
                    os.fstat(f.fileno())
                    f.seek(len(line) * 990)
                    f.read(1 << 20)
            (checked if safe else plain).append(time.perf_counter() - t0)
    return 1e6 * statistics.median(checked), 1e6 * statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--start-rounds", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--read-rounds", type=int, default=20000)
    args = parser.parse_args()
    support = sandbox.detect(Settings())
    if not support.on:
        raise SystemExit(f"no sandbox here: {support.why_not}")
    print(f"# {support.describe()}")
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-sandbox-") as tmp:
        root = Path(tmp)
        checked, opened = read_rounds(root, args.read_rounds)
        per_s = 1 / Settings().poll_s  # the supervisor reads the metrics file once per ship
        print(f"file handling: a metrics read through jobfiles {checked:.1f} us vs a plain open {opened:.1f} us "
              f"(median of {args.read_rounds} alternating), ratio {checked / opened:.2f}; at {per_s:g} reads/s "
              f"per attempt the checks cost {100 * per_s * (checked - opened) / 1e6:.4f}% of one core")
        plain, boxed = [], []
        for i in range(args.start_rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            for b in order:
                (boxed if b else plain).append(start_round(root, 1000 + 2 * i + b, support, b))
        extra = [1000 * (b - p) for b, p in zip(boxed, plain, strict=True)]
        print(f"start: sandbox made and entered around /bin/true, {args.start_rounds} alternating rounds: "
              f"median {1000 * statistics.median(boxed):.1f} ms vs plain {1000 * statistics.median(plain):.1f} ms, "
              f"added median {statistics.median(extra):.1f} ms, max {max(extra):.1f} ms (goal <= 100 ms)")
        ratios = []
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            rate = {b: train_round(root, 10 + 2 * i + b, support, b) for b in order}
            ratios.append(rate[True] / rate[False])
            print(f"pair {i + 1} ({'sandboxed first' if order[0] else 'bare first'}): bare {rate[False]:.0f}, "
                  f"sandboxed {rate[True]:.0f} samples/s, ratio {ratios[-1]:.3f}")
        print(f"step rate sandboxed / bare: median {statistics.median(ratios):.3f}, geometric mean "
              f"{statistics.geometric_mean(ratios):.3f} over {args.pairs} pairs (goal >= 0.99)")


if __name__ == "__main__":
    main()
