"""FSDP vs DDP on the same small GPT, 2 processes: step time and peak memory per rank, in one run.

Bare torchrun (the command line the worker renders), so only the strategy differs. On CPU the
memory figure is rank 0's peak RSS minus its RSS just before the model was built: a rough check of
the plan (it includes allocator slack and gloo buffers; glibc is told to return big frees). On CUDA
it is torch.cuda.max_memory_allocated. Rounds alternate which strategy goes first; the median round
is reported.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_bare  # noqa: E402
from trainjobs import plan as memory_plan  # noqa: E402
from trainjobs.spec import JobSpec  # noqa: E402

SPEC = {
    "name": "bench-strategies",
    "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
    "model": {"type": "gpt", "n_layer": 6, "n_head": 8, "d_model": 512, "seq_len": 64, "vocab_size": 256},
    "data": {"type": "synthetic_lm", "num_samples": 4096, "batch_size": 8},
    "optimizer": {"type": "adamw", "lr": 0.001},
    "train": {"max_steps": 20, "log_every": 5, "seed": 0},
}


def run(spec: dict) -> dict:
    # NOTE: glibc otherwise keeps freed buffers of up to 32 MB in its heap (its mmap threshold grows
    # with each big free), so RSS would count FSDP's freed all-gather buffers as live memory.
    records, _ = run_bare(spec, extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    summary = next(r["summary"] for r in records if r["type"] == "summary")
    # Steady state: the median logged window after the first (which pays warm-up).
    step_times = [r["metrics"]["step_time_s"] for r in records if r["type"] == "metrics"][1:]
    return {"step_time_s": statistics.median(step_times),
            "mem_mb": summary["peak_mem_mb"] - summary["base_mem_mb"], "final_loss": summary["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    specs = {s: {**SPEC, "strategy": s} for s in ("ddp", "fsdp")}
    plan = memory_plan.make_plan(JobSpec.model_validate(specs["ddp"]))
    estimate_mb = {"ddp": plan.ddp.total_bytes / 2**20, "fsdp": plan.fsdp.total_bytes / 2**20}
    time_ratio, mem_ratio, results = [], [], {"ddp": [], "fsdp": []}
    for i in range(args.rounds):
        order = ("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")
        got = {s: run(specs[s]) for s in order}
        for s in order:
            results[s].append(got[s])
        time_ratio.append(got["fsdp"]["step_time_s"] / got["ddp"]["step_time_s"])
        mem_ratio.append(got["fsdp"]["mem_mb"] / got["ddp"]["mem_mb"])
        print(f"round {i + 1}: step time ddp {got['ddp']['step_time_s'] * 1e3:.1f} ms, fsdp "
              f"{got['fsdp']['step_time_s'] * 1e3:.1f} ms; memory added ddp {got['ddp']['mem_mb']:.0f} MB, "
              f"fsdp {got['fsdp']['mem_mb']:.0f} MB")
    print(f"step time, fsdp / ddp: median {statistics.median(time_ratio):.3f} "
          f"(min {min(time_ratio):.3f}, max {max(time_ratio):.3f}) over {args.rounds} rounds")
    print(f"peak memory added per rank, fsdp / ddp: median {statistics.median(mem_ratio):.3f} "
          f"(min {min(mem_ratio):.3f}, max {max(mem_ratio):.3f})")
    for s in ("ddp", "fsdp"):
        measured = statistics.median(r["mem_mb"] for r in results[s])
        estimate = estimate_mb[s]
        print(f"{s}: plan {estimate:.0f} MB per rank, measured (RSS delta) {measured:.0f} MB, "
              f"measured / plan {measured / estimate:.2f}")
    model = SPEC["model"]
    print(f"plan's fsdp / ddp: {estimate_mb['fsdp'] / estimate_mb['ddp']:.3f}; context: {plan.parameters:,} "
          f"parameters ({model['n_layer']} layers, d_model {model['d_model']}), {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
