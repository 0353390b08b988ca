"""The runtime's speed on CPU (issue 34), two rows, each A/B alternated in one run:

1. runtime: the built-in GPT's step time against a plain PyTorch loop of the same model and batch
   (bench/scripts/plain_gpt.py, no trainjobs code), both under the worker's own torchrun command line, 1 rank:
   plain / built-in median step time (goal >= 0.97).
2. script: a user's own script (the same plain loop, 2 ranks) through the service against the same script under
   a bare torchrun as a user starts it from a shell, measured as a user would: the whole job's wall clock (bare:
   the torchrun process; service: submit → `succeeded`, the job's own created_at/finished_at) and per step (the
   script's own median window, from its log). With --ablate a second service runs beside the first with the
   supervisor's extras off (usage sampling off, shipping every 2 s instead of 0.5 s): where the difference goes.
3. account: where the CPU goes while the same script runs through the service, in its steady state (after the
   ranks' start, before their end): the CPU-seconds of every process of the stack (the ranks, torchrun, the
   sandbox, the worker and its work-horse, the API with its scheduler and database), each as a share of the
   ranks'. CPU-seconds hardly move with the machine's load, where a wall-clock ratio on 2 shared cores does.
"""

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import bench_stack, free_port, redis_url, run_bare, wait_job  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64, "vocab": 256}
PLAIN_LINE = re.compile(r"plain_gpt: median step ([\d.]+) s")


def plain_args(steps: int, log_every: int, batch: int) -> list[str]:
    out = ["--steps", str(steps), "--log-every", str(log_every), "--batch", str(batch)]
    for name, value in MODEL.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def builtin_spec(steps: int, log_every: int, batch: int, nproc: int = 1) -> dict:
    return {"name": "bench-runtime-speed", "strategy": "ddp", "resources": {"nproc_per_node": nproc, "device": "cpu"},
            "model": {"type": "gpt", "n_layer": MODEL["n_layer"], "n_head": MODEL["n_head"],
                      "d_model": MODEL["d_model"], "seq_len": MODEL["seq_len"], "vocab_size": MODEL["vocab"]},
            "data": {"type": "synthetic_lm", "num_samples": batch * nproc * 64, "batch_size": batch},
            "optimizer": {"type": "adamw", "lr": 3e-4},
            "train": {"max_steps": steps, "log_every": log_every, "compile": False}}


def step_of(output: str) -> float:
    match = PLAIN_LINE.search(output)
    if match is None:
        raise RuntimeError(f"no plain_gpt line in the output:\n{output[-2000:]}")
    return float(match[1])


def run_builtin(steps: int, log_every: int, batch: int) -> float:
    """The built-in runtime under the worker's command line (bench/common.run_bare): its median window step time."""
    records, _ = run_bare(builtin_spec(steps, log_every, batch), extra_env={"OMP_NUM_THREADS": "1"})
    windows = [r["metrics"]["step_time_s"] for r in records if r["type"] == "metrics"]
    return statistics.median(windows[1:] or windows)


def run_plain_as_worker(steps: int, log_every: int, batch: int) -> float:
    """The plain loop under the very same command line and environment (an entrypoint spec rendered by launch)."""
    from trainjobs.spec import JobSpec
    from worker import launch

    spec = JobSpec.model_validate({"resources": {"nproc_per_node": 1, "device": "cpu"}, "entrypoint": {
        "script": "plain_gpt.py", "args": plain_args(steps, log_every, batch)}})
    with tempfile.TemporaryDirectory(prefix="trainjobs-plain-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "tmp").mkdir()
        plan = launch.render(spec, job_id="0" * 20, attempt=1, run_dir=run_dir, python=sys.executable,
                             data_dir=run_dir, job_dir=run_dir / "job", shutdown_grace_s=5,
                             base_env=launch.default_env(), cpu_count=os.cpu_count() or 1, scripts_dir=SCRIPTS,
                             entry_script=SCRIPTS / "plain_gpt.py")
        done = subprocess.run(plan.argv, env={**plan.env, "OMP_NUM_THREADS": "1"}, cwd=run_dir, capture_output=True,
                              text=True)
    if done.returncode != 0:
        raise RuntimeError(f"plain loop exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return step_of(done.stdout)


def runtime_rounds(rounds: int, steps: int, log_every: int, batch: int) -> list[float]:
    ratios = []
    for i in range(rounds):
        arms = [("builtin", run_builtin), ("plain", run_plain_as_worker)]
        got = {name: fn(steps, log_every, batch) for name, fn in (arms if i % 2 == 0 else arms[::-1])}
        ratios.append(got["plain"] / got["builtin"])
        print(f"runtime round {i + 1}: built-in {1000 * got['builtin']:.2f} ms/step, plain loop "
              f"{1000 * got['plain']:.2f} ms/step, plain / built-in {ratios[-1]:.3f}", flush=True)
    print(f"the built-in GPT against a plain PyTorch loop (1 rank, {MODEL}, batch {batch}): plain / built-in "
          f"step time median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
          f"over {rounds} rounds; goal >= 0.97", flush=True)
    return ratios


def run_bare_script(args: list[str]) -> tuple[float, float]:
    """The script under torchrun as a user starts it from a shell: (median step s, wall s of the torchrun)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            str(SCRIPTS / "plain_gpt.py"), *args]
    with tempfile.TemporaryDirectory(prefix="trainjobs-bare-") as tmp:
        started = time.perf_counter()
        done = subprocess.run(argv, env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"bare torchrun exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return step_of(done.stdout), wall


def run_service_script(api, args: list[str]) -> tuple[float, float, float]:
    """The same script as an entrypoint job: (its median step s from its log, submit → finished from the job,
    submit → started: the claim and the launch before torchrun)."""
    spec = {"name": "bench-plain-gpt", "resources": {"nproc_per_node": 2, "device": "cpu"},
            "entrypoint": {"script": "plain_gpt.py", "args": args}}
    job = wait_job(api, api.post("/v1/jobs", json=spec).json()["id"], poll_s=1.0)  # the times are the job's own
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job['status']}: {job['error']}")
    created, started, finished = (datetime.fromisoformat(job[k]) for k in ("created_at", "started_at", "finished_at"))
    return step_of(api.get(f"/v1/jobs/{job['id']}/logs").text), (finished - created).total_seconds(), \
        (started - created).total_seconds()


def script_rounds(apis: dict, rounds: int, args: list[str]) -> dict[str, list[tuple[float, float]]]:
    arms = {"bare": run_bare_script, **{name: (lambda a, api=api: run_service_script(api, a))
                                        for name, api in apis.items()}}
    got = {name: [] for name in arms}
    for i in range(rounds):
        order = list(arms)[i % len(arms):] + list(arms)[: i % len(arms)]
        for name in order:
            got[name].append(arms[name](args))
        print(f"script round {i + 1} ({' → '.join(order)}): " + ", ".join(
            f"{name} {1000 * got[name][-1][0]:.2f} ms/step, {got[name][-1][1]:.2f} s whole" for name in arms),
            flush=True)
    for name in apis:
        per_step = [b[0] / s[0] for b, s in zip(got["bare"], got[name], strict=True)]
        whole = [b[1] / s[1] for b, s in zip(got["bare"], got[name], strict=True)]
        print(f"a user's script, {name} / bare torchrun: per step median {statistics.median(per_step):.3f} "
              f"(min {min(per_step):.3f}, max {max(per_step):.3f}); whole job median {statistics.median(whole):.3f} "
              f"(min {min(whole):.3f}, max {max(whole):.3f}) over {rounds} rounds; goal >= 0.97; submit → started "
              f"median {statistics.median(s[2] for s in got[name]):.2f} s, the whole job's extra over bare median "
              f"{statistics.median(s[1] - b[1] for b, s in zip(got['bare'], got[name], strict=True)):+.2f} s",
              flush=True)
    return got


def component(proc: psutil.Process) -> str:
    """Which part of the stack a process of this bench is."""
    cmd = " ".join(proc.cmdline())
    if proc.name() == "bwrap":
        return "sandbox (bwrap)"
    if "torch.distributed.run" in cmd or "torchrun" in cmd:
        return "torchrun"
    if "plain_gpt.py" in cmd:
        return "ranks"
    if "uvicorn" in cmd:
        return "API (scheduler, sweeper, database)"
    if "worker.main" in cmd:
        return "worker (supervisor, shipping, lease)"
    return "other: " + cmd[:60]


def cpu_by_component() -> dict[int, tuple[str, float]]:
    """pid -> (component, CPU-seconds so far) for every process this bench started."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            times = proc.cpu_times()
            out[proc.pid] = (component(proc), times.user + times.system)
        except psutil.Error:
            continue
    return out


def account_row(api, args: list[str], settle_s: float, window_s: float) -> dict[str, float]:
    """CPU-seconds per component in a window of the script's steady state, as a share of the ranks'."""
    spec = {"name": "bench-plain-gpt-account", "resources": {"nproc_per_node": 2, "device": "cpu"},
            "entrypoint": {"script": "plain_gpt.py", "args": args}}
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_job(api, job_id, until={"running", "succeeded", "failed", "cancelled"}, poll_s=0.5)
    time.sleep(settle_s)  # past the ranks' imports and first steps
    before = cpu_by_component()
    time.sleep(window_s)
    after = cpu_by_component()
    job = api.get(f"/v1/jobs/{job_id}").json()
    if job["status"] != "running":
        raise RuntimeError(f"the job was {job['status']} at the window's end: give it more --steps")
    spent = collections.Counter()
    for pid, (name, cpu) in after.items():
        spent[name] += cpu - before.get(pid, (name, 0.0))[1]
    api.post(f"/v1/jobs/{job_id}/cancel")
    ranks = spent.pop("ranks")
    print(f"CPU in a {window_s:.0f} s window of the script's steady state (2 ranks): ranks {ranks:.2f} CPU-s; "
          + "; ".join(f"{name} {cpu:.2f} CPU-s = {100 * cpu / ranks:.2f}% of the ranks'"
                      for name, cpu in spent.most_common()), flush=True)
    return {name: cpu / ranks for name, cpu in spent.items()}


@contextmanager
def quiet_stack():
    """A second service beside the first (its own queue): usage sampling off, shipping every 2 s."""
    from service.cli.stack import Stack
    from service.settings import Settings

    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-quiet-") as tmp:
        settings = Settings(data_dir=Path(tmp), redis_url=redis_url(), queue_prefix=f"bench{os.getpid()}quiet",
                            allow_entrypoints=True, scripts_dir=SCRIPTS, usage_sample_s=0, poll_s=2.0)
        with Stack(settings, port=free_port(), workers=1, quiet=True) as stack, stack.client(timeout=30) as api:
            yield api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--row", choices=["runtime", "script", "both", "account"], default="both")
    parser.add_argument("--window", type=float, default=20.0, help="the account row's window, seconds")
    parser.add_argument("--ablate", action="store_true", help="a second service with usage sampling off and "
                        "shipping every 2 s, in the script row")
    args = parser.parse_args()
    if args.row == "account":
        with bench_stack(allow_entrypoints=True, scripts_dir=SCRIPTS) as (_stack, api):
            for _ in range(args.rounds):
                account_row(api, plain_args(args.steps, args.log_every, args.batch), 8.0, args.window)
        return
    if args.row != "script":
        runtime_rounds(args.rounds, args.steps, args.log_every, args.batch)
    if args.row == "runtime":
        return
    script_args = plain_args(args.steps, args.log_every, args.batch)
    with bench_stack(allow_entrypoints=True, scripts_dir=SCRIPTS) as (_stack, api):
        if not args.ablate:
            script_rounds({"service": api}, args.rounds, script_args)
        else:
            with quiet_stack() as quiet:
                script_rounds({"service": api, "service-quiet": quiet}, args.rounds, script_args)
    print(f"context: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
