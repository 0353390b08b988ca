"""The device check (issue 34), one script for a lent GPU machine: the built-in GPT through the real service.

On one GPU: DDP and FSDP, torch.compile on and off (most telling first); with more GPUs, the same compiled on all
of them (NCCL). One table: the plan's per-device memory beside the measured peak (torch's allocator, and NVML's),
tokens/s, MFU against the device's bf16 peak (trainjobs/peaks.py), GPU busy %. The micro-batch is the largest
the memory plan fits (trainjobs/plan.py, with its headroom), capped by --max-batch. Jobs start only while the
--budget-s lasts (default 8 minutes, all in); a skipped row says so.

First, on cuda, the GPU check of issue 30: two 1-GPU jobs at once, each must see exactly the GPU its attempt was
assigned, by UUID (`CUDA_VISIBLE_DEVICES`, torch and `nvidia-smi -L` from inside the job's sandbox).

`--dry-run` plans every row and prints the table's head without a service or a GPU (a CPU test runs it);
`--device cpu --size small` runs the same rows for real on gloo (no MFU: a CPU has no peak in the table).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainjobs.plan import WorkerMemory, make_plan  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402

SIZES = {  # ~0.94B parameters: the class the issue's MFU goal names; and a toy for CPU runs
    "large": {"type": "gpt", "n_layer": 16, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 32768},
    "small": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 32, "vocab_size": 256},
}
JOB_START_S = 90  # a row starts only with this much budget left (start, compile, steps, the final save)
SEES = """import json, os, subprocess, time, torch
listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
print("SEES " + json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
      "torch": [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())],
      "smi": [line for line in listed if "UUID" in line]}), flush=True)
time.sleep(10)  # two such jobs overlap: each holds its GPU while the other starts
"""


@dataclass(frozen=True)
class Row:
    strategy: str
    compile: bool
    nproc: int

    @property
    def label(self) -> str:
        return f"{self.strategy} {'compiled' if self.compile else 'eager'} x{self.nproc}"


def rows(gpus: int) -> list[Row]:
    one = [Row("fsdp", True, 1), Row("ddp", True, 1), Row("fsdp", False, 1), Row("ddp", False, 1)]
    return one + ([Row("fsdp", True, gpus), Row("ddp", True, gpus)] if gpus > 1 else [])


def spec(row: Row, *, device: str, size: str, batch: int, steps: int, gpu_memory_gb: float | None) -> dict:
    return {
        "name": f"device-{row.strategy}-{'compiled' if row.compile else 'eager'}-{row.nproc}",
        "strategy": row.strategy,
        "resources": {"nproc_per_node": row.nproc, "device": device, "gpu_memory_gb": gpu_memory_gb},
        "model": SIZES[size],
        "data": {"type": "synthetic_lm", "num_samples": batch * row.nproc * (steps + 2), "batch_size": batch},
        "optimizer": {"type": "adamw", "lr": 3e-4},
        "train": {"max_steps": steps, "log_every": max(1, steps // 4), "compile": row.compile},
        "fsdp": {"mixed_precision": "bf16" if device == "cuda" else "fp32"},
        "timeout_s": 900,
    }


def largest_batch(row: Row, *, device: str, size: str, steps: int, gpu_memory_gb: float | None,
                  workers: list[WorkerMemory], cap: int) -> tuple[int, int]:
    """The largest power-of-two micro-batch (<= cap) whose plan fits the device with the plan's headroom, and its
    estimate in bytes (batch 1 when even that does not fit: the job then says why)."""
    best, estimate = 1, 0
    batch = 1
    while batch <= cap:
        plan = make_plan(JobSpec.model_validate(spec(row, device=device, size=size, batch=batch, steps=steps,
                                                     gpu_memory_gb=gpu_memory_gb)), workers)
        need = getattr(plan, row.strategy).total_bytes
        if need > plan.limit_gib * 2**30:
            break
        best, estimate, batch = batch, need, batch * 2
    return best, estimate


def header() -> str:
    return (f"{'row':<20} {'batch':>5} {'plan MB':>9} {'peak MB':>9} {'NVML MB':>9} {'peak/plan':>9} "
            f"{'tokens/s':>11} {'MFU':>6} {'GPU %':>5} {'loss':>6}  status")


def line(row: Row, batch: int, plan_mb: float, job: dict | None, note: str = "") -> str:
    """One row of the table from the job as GET /v1/jobs/{id} returns it (None: not run)."""
    if job is None or job.get("status") != "succeeded":
        status = note or (f"{job['status']}: {(job.get('error') or {}).get('message', '')[:60]}" if job else "")
        blank = f"{'':>9} {'':>9} {'':>9} {'':>11} {'':>6} {'':>5} {'':>6}"
        return f"{row.label:<20} {batch:>5} {plan_mb:>9.0f} {blank}  {status}"
    perf, summary = job.get("performance") or {}, job.get("summary") or {}
    peak = (job.get("memory") or {}).get("measured_peak_mb")

    def num(value, spec_: str) -> str:
        return format(value, spec_) if isinstance(value, int | float) else "-"

    mfu = f"{100 * perf['mfu']:.1f}%" if isinstance(perf.get("mfu"), float) else "n/a"
    ratio = peak / plan_mb if isinstance(peak, int | float) and plan_mb else None
    return (f"{row.label:<20} {batch:>5} {plan_mb:>9.0f} {num(peak, '9.0f'):>9} "
            f"{num(perf.get('gpu_mem_peak_mb'), '9.0f'):>9} {num(ratio, '9.2f'):>9} "
            f"{num(perf.get('tokens_per_s'), '11,.0f'):>11} {mfu:>6} {num(perf.get('gpu_util'), '5.0f'):>5} "
            f"{num(summary.get('final_loss'), '6.3f'):>6}  ok")


def gpu_memory_mib() -> list[int]:
    """Each GPU's total memory as nvidia-smi lists it (none without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout
    return [int(float(v)) for v in out.split() if v.replace(".", "", 1).isdigit()]


def run_row(api, job_spec: dict) -> dict:
    from bench.common import wait_job

    job = api.post("/v1/jobs", json=job_spec).json()
    if "id" not in job:
        return {"status": "refused", "error": {"message": str(job)[:200]}}
    return wait_job(api, job["id"], poll_s=1.0, timeout=900)


def uuid_check(api, scripts: Path, gpus: int) -> str:
    """Issue 30 on a GPU: min(2, gpus) 1-GPU jobs at once; each job's ranks see exactly the GPU its attempt was
    assigned (GET /v1/jobs/{id} `placement`), by UUID, and no other; with two, they are different GPUs."""
    import json

    from bench.common import wait_job

    (scripts / "sees.py").write_text(SEES)
    spec_ = {"name": "device-uuid-check", "resources": {"nproc_per_node": 1, "device": "cuda"},
             "entrypoint": {"script": "sees.py"}, "timeout_s": 120}
    ids = [api.post("/v1/jobs", json=spec_).json().get("id") for _ in range(min(2, max(gpus, 1)))]
    if not all(ids):
        return "uuid check: refused"
    verdicts, assigned, spans = [], [], []
    for job_id in ids:
        job = wait_job(api, job_id, poll_s=1.0, timeout=180)
        spans.append((job.get("started_at") or "", job.get("finished_at") or ""))
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
        seen = next((json.loads(line[5:]) for line in logs.splitlines() if line.startswith("SEES ")), None)
        uuids = [u for p in job.get("placement") or [] for u in p.get("uuids") or []]
        assigned += uuids
        if job["status"] != "succeeded" or seen is None or len(uuids) != 1:
            verdicts.append(f"{job_id}: {job['status']}, assigned {uuids}, saw {seen}")
            continue
        mine = uuids[0].removeprefix("GPU-")
        ok = (seen["count"] == 1 and [u.removeprefix("GPU-") for u in seen["torch"]] == [mine]
              and len(seen["smi"]) == 1 and mine in seen["smi"][0])
        verdicts.append(f"{job_id}: {'ok' if ok else 'WRONG'} (assigned {uuids[0]}, CUDA_VISIBLE_DEVICES="
                        f"{seen['visible']}, torch {seen['torch']}, nvidia-smi {len(seen['smi'])} GPU)")
    overlapped = len(spans) == 2 and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]
    shared = overlapped and len(set(assigned)) < len(assigned)
    return ("uuid check: " + "; ".join(verdicts) + ("; WRONG: two jobs held the same GPU at once" if shared else "")
            + ("" if overlapped or len(ids) == 1 else "; the two jobs did not overlap"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=list(SIZES), default=None, help="default: large on cuda, small on cpu")
    parser.add_argument("--gpus", type=int, default=None, help="default: what nvidia-smi lists (1 on cpu)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="for the plan; default: the worker's")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--dry-run", action="store_true", help="plan and print the rows; run nothing")
    args = parser.parse_args(sys.argv[1:])
    started = time.monotonic()
    size = args.size or ("large" if args.device == "cuda" else "small")
    memory = gpu_memory_mib() if args.device == "cuda" else []
    gpus = args.gpus if args.gpus is not None else (len(memory) if args.device == "cuda" else 1)
    # The plan reads the smallest GPU as a live worker reports it (none listed: the plan's 80 GiB default).
    workers = [WorkerMemory(device="cuda", gpu_count=len(memory), gpu_memory_bytes=min(memory) * 2**20)] \
        if memory else []
    planned = []
    for row in rows(max(gpus, 1)):
        batch, estimate = largest_batch(row, device=args.device, size=size, steps=args.steps,
                                        gpu_memory_gb=args.gpu_memory_gb, workers=workers, cap=args.max_batch)
        planned.append((row, batch, estimate / 2**20))
    print(f"device check: {size} GPT on {args.device} ({gpus} GPU{'s' if gpus != 1 else ''} listed), "
          f"{args.steps} steps per row, budget {args.budget_s:.0f} s", flush=True)
    print(header(), flush=True)
    if args.dry_run:
        for row, batch, plan_mb in planned:
            print(line(row, batch, plan_mb, None, "planned (dry run)"), flush=True)
        return
    from bench.common import bench_stack

    with tempfile.TemporaryDirectory(prefix="trainjobs-gpu-scripts-") as scripts, \
            bench_stack(allow_entrypoints=True, scripts_dir=Path(scripts)) as (_stack, api):
        if args.device == "cuda":
            print(uuid_check(api, Path(scripts), gpus), flush=True)
        for row, batch, plan_mb in planned:
            left = args.budget_s - (time.monotonic() - started)
            if left < JOB_START_S:
                print(line(row, batch, plan_mb, None, f"skipped: {left:.0f} s of the budget left"), flush=True)
                continue
            job_spec = spec(row, device=args.device, size=size, batch=batch, steps=args.steps,
                            gpu_memory_gb=args.gpu_memory_gb)
            job_spec["timeout_s"] = max(60, left - 10)
            print(line(row, batch, plan_mb, run_row(api, job_spec)), flush=True)
    print(f"context: {os.cpu_count()} cores; {time.monotonic() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
