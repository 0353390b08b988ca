"""Submit → claimed latency over N jobs (goal p95 <= 0.5 s), measured from the job's own timestamps.

Each job is submitted to an idle worker; once claimed it is cancelled, so the next one finds the
worker idle again. Latency = started_at (the claim's compare-and-set) - created_at (the insert).
"""

import argparse
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, percentile, wait_job  # noqa: E402

SPEC = {
    "name": "bench-claim",
    "resources": {"nproc_per_node": 1},
    "model": {"type": "mlp", "hidden": [8]},
    "data": {"type": "synthetic_regression", "num_samples": 64, "batch_size": 8},
    "train": {"max_steps": 1_000_000, "log_every": 1000},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=50)
    args = parser.parse_args()
    latencies = []
    with bench_stack(cancel_grace_s=2) as (_stack, api):
        for _ in range(args.jobs):
            job = api.post("/v1/jobs", json=SPEC).json()
            claimed = wait_job(api, job["id"], until=("starting", "running", "failed"), poll_s=0.01)
            started = datetime.fromisoformat(claimed["started_at"])
            latencies.append((started - datetime.fromisoformat(claimed["created_at"])).total_seconds())
            api.post(f"/v1/jobs/{job['id']}/cancel")
            done = wait_job(api, job["id"])
            assert done["status"] == "cancelled", done["status"]
    p50, p95 = percentile(latencies, 0.5), percentile(latencies, 0.95)
    print(f"submit → claimed over {len(latencies)} jobs: p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms; goal p95 <= 500 ms ({'met' if p95 <= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
