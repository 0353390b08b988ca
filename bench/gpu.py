"""The device check: an NCCL DDP job and an FSDP bf16 job through the real service, on one machine.

Prints, for each: the plan's per-device estimate beside the measured peak (torch.cuda.max_memory_allocated
of rank 0, from the job's summary), measured / plan, tokens/s and MFU, and the use the worker sampled
(`gpu_util`, `gpu_mem`: worker/usage.py, NVML or nvidia-smi; on CPU `cpu_util/rank<r>`). `--device cpu` runs the same on
gloo as a dry run (no MFU; the peak is RSS there). One script, so a lent GPU machine runs it in one call.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, wait_job  # noqa: E402


def spec(strategy: str, device: str, nproc: int, size: str) -> dict:
    big = size == "large"
    model = ({"type": "gpt", "n_layer": 12, "n_head": 16, "d_model": 1024, "seq_len": 1024, "vocab_size": 32768}
             if big else {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 32, "vocab_size": 256})
    return {
        "name": f"device-{strategy}", "strategy": strategy,
        "resources": {"nproc_per_node": nproc, "device": device},
        "model": model,
        "data": {"type": "synthetic_lm", "num_samples": 20_000 if big else 512, "batch_size": 8 if big else 4},
        "optimizer": {"type": "adamw", "lr": 3e-4},
        "train": {"max_steps": 60 if big else 10, "log_every": 10 if big else 5},
        "fsdp": {"mixed_precision": "bf16" if device == "cuda" else "fp32"},
        "timeout_s": 900,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--size", choices=["large", "small"], default="large")
    args = parser.parse_args()
    with bench_stack() as (_stack, api):
        for strategy in ("ddp", "fsdp"):
            job = api.post("/v1/jobs", json=spec(strategy, args.device, args.nproc, args.size)).json()
            if "id" not in job:
                raise SystemExit(f"submission refused: {job}")
            job = wait_job(api, job["id"], poll_s=1.0, timeout=900)
            if job["status"] != "succeeded":
                logs = api.get(f"/v1/jobs/{job['id']}/logs").text
                raise SystemExit(f"{strategy}: {job['status']}: {job['error']}\n{logs[-3000:]}")
            s, memory = job["summary"], job["memory"]
            ratio = memory["measured_peak_mb"] / memory["estimated_mb"] if memory["estimated_mb"] else float("nan")
            mfu = f"{100 * s['mfu']:.1f}%" if "mfu" in s else "n/a"
            print(f"{strategy}: {s['parameters']:,} parameters on {s['world_size']} x {s['device']}; plan "
                  f"{memory['estimated_mb']:.0f} MB/device, measured peak {memory['measured_peak_mb']:.0f} MB, "
                  f"measured / plan {ratio:.2f}; {s.get('tokens_per_s', 0):,.0f} tokens/s, MFU {mfu}; "
                  f"final loss {s['final_loss']:.3f}", flush=True)
            usage = {u["name"]: u["values"] for u in api.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]
                     if u["name"] in ("gpu_util", "gpu_mem") or u["name"].startswith("cpu_util/")}
            print(f"{strategy}: usage sampled by the worker (worker/usage.py): " + (", ".join(
                f"{name} median {sorted(v)[len(v) // 2]:.1f} over {len(v)} points" for name, v in sorted(usage.items()))
                or "none"), flush=True)
    print(f"context: {os.cpu_count()} cores; plan device memory source: {job['plan']['device_memory_source']}")


if __name__ == "__main__":
    main()
