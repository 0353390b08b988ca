"""The same 27-trial random search run (a) without early stopping and (b) with ASHA, on the real stack, one after
the other: the device-seconds each spent and the best metric each found (issue 17's benchmark).

Device-seconds: the sum over trials of the processes (slots) each held × its run time (claimed to ended: start-up,
training and stopping all count, as they hold the device). Training device-seconds count from each trial's first
reported point instead, leaving out the start-up that every trial pays whether stopped or not. Goal: ASHA ≤ 0.5×
the device-seconds of (a), with a best metric within 2% of (a)'s.

The trials are tiny MLPs on CPU (one process each, three workers, so three at a time); each step also sleeps
--step-s (fault_injection.sleep_per_step_s) to stand for a device step's time without taking this shared machine's
cores. Both arms draw the same 27 parameter sets (same seed); the metric is eval_loss on the held-out split.
"""

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack  # noqa: E402


def search(args, early_stopping: dict | None) -> dict:
    spec = {
        "name": "bench-sweep",
        "resources": {"nnodes": 1, "nproc_per_node": 1, "device": "cpu"},
        "model": {"type": "mlp", "hidden": [32]},
        "data": {"type": "synthetic_regression", "num_samples": 2048, "batch_size": 32},
        "optimizer": {"type": "adamw", "lr": 0.001},
        "train": {"max_steps": args.steps, "log_every": 3, "eval_every": 9, "eval_batches": 4, "seed": 0},
        "fault_injection": {"sleep_per_step_s": args.step_s, "rank": 0},
    }
    return {
        "name": "bench-asha" if early_stopping else "bench-full",
        "spec": spec,
        "parameters": {"optimizer.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 0.3},
                       "optimizer.weight_decay": {"distribution": "uniform", "min": 0.0, "max": 0.1}},
        "method": "random", "max_trials": args.trials, "parallel": args.workers, "seed": args.seed,
        "metric": {"name": "eval_loss", "goal": "minimize"},
        "early_stopping": early_stopping,
    }


def run(api, body: dict) -> dict:
    started = time.monotonic()
    sweep = api.post("/v1/sweeps", json=body)
    sweep.raise_for_status()
    sweep_id = sweep.json()["id"]
    while (sweep := api.get(f"/v1/sweeps/{sweep_id}").json())["status"] == "running":
        time.sleep(1.0)
    wall = time.monotonic() - started
    trials = api.get(f"/v1/sweeps/{sweep_id}/trials").json()["data"]
    slots = body["spec"]["resources"]["nproc_per_node"]
    return {"status": sweep["status"], "wall_s": wall, "device_s": sum(slots * (t["run_s"] or 0) for t in trials),
            "training_s": sum(slots * training_s(api, t) for t in trials),
            "best": sweep["best"]["best"] if sweep["best"] else None,
            "best_params": sweep["best"]["params"] if sweep["best"] else None,
            "steps": sum(t["steps"] for t in trials), "stopped": sweep["trials"]["stopped_early"],
            "failed": sweep["trials"]["failed"]}


def training_s(api, trial: dict) -> float:
    """From the trial's first reported point (its first log step: start-up and imports behind it) to its end."""
    if not trial["finished_at"]:
        return 0.0
    lines = api.get(f"/v1/jobs/{trial['job_id']}/metrics", params={"format": "csv", "name": "loss"}).text.splitlines()
    if len(lines) < 2:
        return 0.0
    first = datetime.fromisoformat(lines[1].rsplit(",", 1)[1].replace("Z", "+00:00"))
    return max(0.0, (datetime.fromisoformat(trial["finished_at"]) - first).total_seconds())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=27)
    parser.add_argument("--steps", type=int, default=81, help="max_steps of a trial")
    parser.add_argument("--step-s", type=float, default=0.2, help="each step's stand-in device time")
    parser.add_argument("--workers", type=int, default=3, help="one-process workers: trials at once")
    parser.add_argument("--min-steps", type=int, default=9, help="ASHA's first rung")
    parser.add_argument("--reduction-factor", type=int, default=3)
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args()
    asha = {"type": "asha", "min_steps": args.min_steps, "reduction_factor": args.reduction_factor}
    # The workers start once the API is up (on a loaded 2-core machine all at once overran its 30 s wait).
    with bench_stack(workers=0, sweep_s=0.5, poll_s=0.2, cancel_grace_s=3) as (stack, api):
        stack.add_workers(args.workers)
        results = {"none": run(api, search(args, None)), "asha": run(api, search(args, asha))}
    print(f"{args.trials} trials × {args.steps} steps (+{args.step_s} s a step), {args.workers} at a time; "
          f"ASHA min_steps {args.min_steps}, reduction factor {args.reduction_factor}")
    print(f"{'arm':<6} {'status':<10} {'device-s':>9} {'training-s':>11} {'wall-s':>7} {'steps':>6} {'stopped':>8} "
          f"{'failed':>7} {'best eval_loss':>15}  best params")
    for arm, r in results.items():
        params = {k: round(v, 6) for k, v in (r["best_params"] or {}).items()}
        print(f"{arm:<6} {r['status']:<10} {r['device_s']:>9.1f} {r['training_s']:>11.1f} {r['wall_s']:>7.1f} "
              f"{r['steps']:>6} {r['stopped']:>8} {r['failed']:>7} {r['best']:>15.6g}  {params}")
    none, asha_r = results["none"], results["asha"]
    ratio, best = asha_r["device_s"] / none["device_s"], asha_r["best"] / none["best"]
    print(f"ASHA / none: device-seconds {ratio:.3f} (goal <= 0.5), training device-seconds "
          f"{asha_r['training_s'] / none['training_s']:.3f}, steps {asha_r['steps'] / none['steps']:.3f}, "
          f"best metric {best:.4f} (goal within 2%: <= 1.02) -> {'PASS' if ratio <= 0.5 and best <= 1.02 else 'MISS'}")


if __name__ == "__main__":
    main()
