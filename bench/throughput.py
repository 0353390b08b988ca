"""Training throughput through the service vs. the same work under a bare torchrun, in one run.

The service adds a supervisor that ships logs and metrics to the database while training runs;
this measures what that costs the training itself (goal: ratio >= 0.97). Rounds alternate
bare/service so that drift on a shared machine hits both alike; the median round is reported.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import TERMINAL, bench_stack, run_bare, wait_job  # noqa: E402

SPEC = {
    "name": "bench-throughput",
    "strategy": "ddp",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
    "model": {"type": "mlp", "hidden": [256, 256, 256]},
    "data": {"type": "synthetic_regression", "num_samples": 16384, "batch_size": 64, "input_dim": 64},
    "optimizer": {"type": "adamw", "lr": 0.001},
    "train": {"max_steps": 400, "log_every": 10, "seed": 0},
}


def run_bare_round(spec: dict) -> dict:
    records, wall = run_bare(spec)
    summary = next(r["summary"] for r in records if r["type"] == "summary")
    return {"samples_per_s": summary["samples_per_s"], "wall_s": wall}


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run_service(stack, api, spec: dict) -> dict:
    """One job through the service; also the CPU that the service's own processes spent meanwhile."""
    own = [psutil.Process(p.pid) for name, p in stack.procs if name in ("api", "worker-0")]
    start = sum(cpu_s(p) for p in own)
    job = api.post("/v1/jobs", json=spec).json()
    horse_cpu = 0.0  # the RQ work-horse = the supervisor; it exits with the job, so keep the last reading
    while (job := api.get(f"/v1/jobs/{job['id']}").json())["status"] not in TERMINAL:
        for horse in own[1].children():
            try:
                horse_cpu = cpu_s(horse)
            except psutil.NoSuchProcess:
                pass
        time.sleep(1.0)  # a slow poll: the bench itself must not steal the CPU
    assert job["status"] == "succeeded", job["error"]
    overhead = sum(cpu_s(p) for p in own) - start + horse_cpu
    wall = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])).total_seconds()
    return {"samples_per_s": job["summary"]["samples_per_s"], "wall_s": wall, "service_cpu_s": overhead}


SCRIPTS = Path(__file__).resolve().parent / "scripts"
LOOP_LINE = re.compile(r"ddp_loop: (\d+) steps in ([\d.]+) s, ([\d.]+) steps/s")


def loop_rate(output: str) -> float:
    match = LOOP_LINE.search(output)
    if match is None:
        raise RuntimeError(f"no ddp_loop line in the output:\n{output[-2000:]}")
    return float(match[3])


def run_bare_script(seconds: float) -> float:
    """A user's plain DDP script under torchrun as they would start it from a shell: steps/s."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            str(SCRIPTS / "ddp_loop.py"), "--seconds", str(seconds)]
    with tempfile.TemporaryDirectory(prefix="trainjobs-bare-") as tmp:  # torchrun's torchelastic_* folder
        done = subprocess.run(argv, env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bare torchrun exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return loop_rate(done.stdout)


def run_as_worker_launches(seconds: float) -> float:
    """The same script under the very command line, environment, session and output pipe the worker gives it
    (worker/launch.render, start_new_session, prepare_torchrun), without the service running: it separates
    what the launch costs from what the service's own processes cost."""
    from trainjobs.spec import JobSpec
    from worker import launch, processes
    from worker.shipping import OutputPump

    spec = JobSpec.model_validate({"resources": {"nproc_per_node": 2, "device": "cpu"}, "entrypoint": {
        "script": "ddp_loop.py", "args": ["--seconds", str(seconds)]}})
    with tempfile.TemporaryDirectory(prefix="trainjobs-launch-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "tmp").mkdir()
        plan = launch.render(spec, job_id="0" * 20, attempt=1, run_dir=run_dir, python=sys.executable,
                             data_dir=run_dir, job_dir=run_dir / "job", shutdown_grace_s=10,
                             base_env=launch.default_env(), cpu_count=os.cpu_count() or 1, scripts_dir=SCRIPTS,
                             entry_script=SCRIPTS / "ddp_loop.py")
        proc = subprocess.Popen(plan.argv, env=plan.env, cwd=run_dir, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=processes.prepare_torchrun)
        pump, output = OutputPump(proc.stdout.fileno()), b""
        while proc.poll() is None:  # as the supervisor reads it: a thread, taken every poll_s
            output += pump.take()
            time.sleep(0.5)
        pump.wait_closed(5, 0.5, lambda: None)
        proc.stdout.close()
        return loop_rate((output + pump.take()).decode(errors="replace"))


def run_service_script(api, seconds: float) -> float:
    """The same script as an entrypoint job (the worker's scripts dir is bench/scripts): steps/s from its log."""
    spec = {"name": "bench-entrypoint", "resources": {"nproc_per_node": 2, "device": "cpu"},
            "entrypoint": {"script": "ddp_loop.py", "args": ["--seconds", str(seconds)]}}
    job = wait_job(api, api.post("/v1/jobs", json=spec).json()["id"], poll_s=1.0)
    assert job["status"] == "succeeded", job["error"]
    return loop_rate(api.get(f"/v1/jobs/{job['id']}/logs").text)


def entrypoint_rounds(api, rounds: int, seconds: float) -> None:
    """Three ways per round, in a rotating order: bare torchrun, the worker's launch alone, the service."""
    arms = {"bare": run_bare_script, "launch": run_as_worker_launches,
            "service": lambda s: run_service_script(api, s)}
    rates = {name: [] for name in arms}
    for i in range(rounds):
        order = list(arms)[i % 3:] + list(arms)[: i % 3]
        for name in order:
            rates[name].append(arms[name](seconds))
        print(f"entrypoint round {i + 1} ({' → '.join(order)}): " + ", ".join(
            f"{name} {rates[name][-1]:.1f}" for name in arms) + " steps/s")
    for name in ("service", "launch"):
        ratios = [a / b for a, b in zip(rates[name], rates["bare"], strict=True)]
        print(f"a user's DDP script, {name} / bare torchrun: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {rounds} rounds of {seconds:g} s"
              + ("; goal >= 0.97" if name == "service" else ""))
    ratios = [a / b for a, b in zip(rates["service"], rates["launch"], strict=True)]
    print(f"service / the worker's launch alone (what the running service costs): median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=SPEC["train"]["max_steps"])
    parser.add_argument("--row", choices=["runtime", "entrypoint", "both"], default="both",
                        help="the built-in runtime's row, a user's plain DDP script's (bench/scripts), or both")
    parser.add_argument("--entry-seconds", type=float, default=6.0, help="each entrypoint run's training time")
    args = parser.parse_args()
    spec = json.loads(json.dumps(SPEC))
    spec["train"]["max_steps"] = args.steps
    ratios, e2e, bare_sps, svc_sps, cpu_share = [], [], [], [], []
    with bench_stack(allow_entrypoints=True, scripts_dir=SCRIPTS) as (stack, api):
        if args.row != "runtime":
            entrypoint_rounds(api, args.rounds, args.entry_seconds)
        if args.row == "entrypoint":
            return
        for i in range(args.rounds):
            if i % 2 == 0:  # alternate which goes first, so drift does not favour either
                bare, svc = run_bare_round(spec), run_service(stack, api, spec)
            else:
                svc, bare = run_service(stack, api, spec), run_bare_round(spec)
            ratios.append(svc["samples_per_s"] / bare["samples_per_s"])
            e2e.append(bare["wall_s"] / svc["wall_s"])
            bare_sps.append(bare["samples_per_s"])
            svc_sps.append(svc["samples_per_s"])
            cpu_share.append(svc["service_cpu_s"] / svc["wall_s"])
            print(f"round {i + 1}: bare {bare['samples_per_s']:.0f} samples/s, service {svc['samples_per_s']:.0f} "
                  f"samples/s, ratio {ratios[-1]:.3f}; wall bare {bare['wall_s']:.1f}s, "
                  f"service (submit→finished) {svc['wall_s']:.1f}s")
    print(f"training throughput, service / bare torchrun: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.rounds} rounds; goal >= 0.97")
    print(f"CPU of the service's own processes (API, RQ worker, supervisor) while the job ran: median "
          f"{100 * statistics.median(cpu_share):.1f}% of one core")
    print(f"end-to-end wall time, bare / service: median {statistics.median(e2e):.3f}")
    print(f"context: bare {statistics.median(bare_sps):.0f} samples/s, service {statistics.median(svc_sps):.0f} "
          f"samples/s, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
