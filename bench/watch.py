"""What watching a job costs, and how fast it answers (issue 18), in one run.

1. Step time with the watch on vs off: the same 2-rank DDP spec, once as submitted (hang detection, each
   rank's own step time gathered per log window for stragglers, usage sampled for idleness) and once with
   `hang`, `straggler` and `idle` each `enabled: false`; rounds alternate which goes first; the figure is
   the training's own samples/s (its summary), on ÷ off per round. Goal: ≥ 0.99.
2. Hang to detection: a 2-rank job whose rank 1 blocks at step 20 (hang.min_s 3, action fail); from the time
   of its last metric point (step 20, written just before the rank blocks) to the stored dump's `taken_at`.
3. A stack dump of a 2-rank job: `worker.stacks.dump` (py-spy on each rank, as the supervisor calls it) on a
   running job's torchrun, and `POST /v1/jobs/{id}/stacks` as a user waits for it. Beside it, the direct cost
   of the usage sampling on the same job: the CPU one sample of its ranks takes (psutil).
"""

import argparse
import csv
import io
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

from bench.common import bench_stack, wait_job  # noqa: E402
from service.settings import Settings  # noqa: E402
from trainjobs.runenv import RUN_TAG_ENV  # noqa: E402
from worker import stacks, usage  # noqa: E402

SPEC = {
    "name": "bench-watch",
    "strategy": "ddp",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
    "model": {"type": "mlp", "hidden": [256, 256, 256]},
    "data": {"type": "synthetic_regression", "num_samples": 16384, "batch_size": 64, "input_dim": 64},
    "optimizer": {"type": "adamw", "lr": 0.001},
    "train": {"max_steps": 400, "log_every": 10, "seed": 0},
}
OFF = {"hang": {"enabled": False}, "straggler": {"enabled": False}, "idle": {"enabled": False}}


def samples_per_s(api, spec: dict) -> float:
    job = wait_job(api, api.post("/v1/jobs", json=spec).json()["id"], poll_s=1.0)
    assert job["status"] == "succeeded", job["error"]
    return job["summary"]["samples_per_s"]


def cost_rounds(api, rounds: int, steps: int) -> None:
    on = json.loads(json.dumps(SPEC))
    on["train"]["max_steps"] = steps
    off = {**on, **OFF}
    ratios, rates = [], {"on": [], "off": []}
    for i in range(rounds):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")  # alternate, so drift favours neither
        for arm in order:
            rates[arm].append(samples_per_s(api, on if arm == "on" else off))
        ratios.append(rates["on"][-1] / rates["off"][-1])
        print(f"round {i + 1} ({' → '.join(order)}): on {rates['on'][-1]:.0f}, off {rates['off'][-1]:.0f} "
              f"samples/s, on / off {ratios[-1]:.3f}", flush=True)
    print(f"step time, watch on / off (samples/s ratio): median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {rounds} rounds of {steps} steps; goal >= 0.99")


def hang_detection(api, min_s: float) -> None:
    spec = {**SPEC, "name": "bench-hang", "hang": {"min_s": min_s, "action": "fail"},
            "train": {"max_steps": 1000, "log_every": 5, "seed": 0},
            "fault_injection": {"hang_at_step": 20, "rank": 1}}
    job = wait_job(api, api.post("/v1/jobs", json=spec).json()["id"], poll_s=0.5)
    assert job["error"] and job["error"]["type"] == "hang", job["error"]
    points = csv.DictReader(io.StringIO(api.get(f"/v1/jobs/{job['id']}/metrics",
                                                params={"format": "csv", "name": "loss"}).text))
    last = max((p for p in points), key=lambda p: int(p["step"]))
    assert int(last["step"]) == 20, last
    [attempt] = api.get(f"/v1/jobs/{job['id']}/attempts").json()["data"]
    taken = datetime.fromisoformat(attempt["stacks"]["taken_at"])
    took = (taken - datetime.fromisoformat(last["time"])).total_seconds()
    print(f"hang → detected (dump stored on the attempt): {took:.2f} s with hang.min_s {min_s:g}: "
          f"{took - min_s:.2f} s past the bound (poll, then py-spy on both ranks)", flush=True)


def torchrun_of(job_id: str) -> psutil.Process:
    prefix = f"{RUN_TAG_ENV}={job_id}.".encode()
    for proc in psutil.process_iter():
        try:
            if "torch.distributed.run" not in proc.cmdline():
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if any(v.startswith(prefix) for v in f.read().split(b"\0")):
                    return proc
        except (OSError, psutil.Error):
            continue
    raise RuntimeError(f"no torchrun of job {job_id}")


def dump_times(api, count: int) -> None:
    spec = {**SPEC, "name": "bench-stacks", "train": {"max_steps": 100_000_000, "log_every": 50, "seed": 0}}
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    try:
        deadline = time.monotonic() + 300
        while (api.get(f"/v1/jobs/{job_id}").json().get("progress") or {}).get("step", 0) < 50:
            if time.monotonic() > deadline:
                raise TimeoutError("the stacks job did not reach step 50")
            time.sleep(0.5)
        torchrun = torchrun_of(job_id)
        direct, asked = [], []
        for _ in range(count):
            began = time.perf_counter()
            dump = stacks.dump(torchrun.pid, reason="bench")
            direct.append(time.perf_counter() - began)
            assert [r["rank"] for r in dump["ranks"]] == [0, 1] and all("MainThread" in r["text"]
                                                                       for r in dump["ranks"]), dump
            began = time.perf_counter()
            answer = api.post(f"/v1/jobs/{job_id}/stacks")
            asked.append(time.perf_counter() - began)
            assert answer.status_code == 200, answer.text
        sampler, sampled = usage.RankCpu(), []
        for _ in range(50):
            began = time.process_time()
            assert sampler.read(torchrun.pid) is not None
            sampled.append(time.process_time() - began)
        cost = statistics.median(sampled)
        print(f"a usage sample of the 2 ranks (usage.RankCpu.read, psutil): median {1000 * cost:.2f} ms of CPU, "
              f"so {100 * cost / Settings().usage_sample_s:.3f}% of one core at one sample every "
              f"{Settings().usage_sample_s:g} s", flush=True)
        print(f"stack dump of a 2-rank job, worker.stacks.dump (py-spy per rank): median "
              f"{statistics.median(direct):.3f} s (min {min(direct):.3f}, max {max(direct):.3f}); "
              f"POST /v1/jobs/{{id}}/stacks answered: median {statistics.median(asked):.3f} s "
              f"(min {min(asked):.3f}, max {max(asked):.3f}), {count} each", flush=True)
    finally:
        api.post(f"/v1/jobs/{job_id}/cancel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=SPEC["train"]["max_steps"])
    parser.add_argument("--hang-min-s", type=float, default=3.0)
    parser.add_argument("--dumps", type=int, default=5)
    args = parser.parse_args()
    with bench_stack() as (_, api):
        cost_rounds(api, args.rounds, args.steps)
        hang_detection(api, args.hang_min_s)
        dump_times(api, args.dumps)


if __name__ == "__main__":
    main()
