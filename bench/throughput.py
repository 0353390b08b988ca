"""Training throughput through the service vs. the same work under a bare torchrun, in one run.

The service adds a supervisor that ships logs and metrics to the database while training runs;
this measures what that costs the training itself (goal: ratio >= 0.97). Rounds alternate
bare/service so that drift on a shared machine hits both alike; the median round is reported.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import TERMINAL, bench_stack, run_bare  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=SPEC["train"]["max_steps"])
    args = parser.parse_args()
    spec = json.loads(json.dumps(SPEC))
    spec["train"]["max_steps"] = args.steps
    ratios, e2e, bare_sps, svc_sps, cpu_share = [], [], [], [], []
    with bench_stack() as (stack, api):
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
