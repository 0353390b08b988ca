"""The training entry point under torchrun: init, build, train, close."""

import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from service.jobs.spec import JobSpec
from worker.launch import SPEC_FILE
from worker.train.data import build_dataset
from worker.train.distributed import cleanup_and_exit, init_distributed, mean_across_ranks, peak_memory_mb
from worker.train.models import build_model, loss_fn
from worker.train.optim import build_optimizer, lr_at
from worker.train.report import METRICS_FILE_ENV, Reporter
from worker.train.strategies import apply_strategy


def train(spec: JobSpec, data_dir: Path, reporter_path: Path | None) -> None:
    d = init_distributed(spec.resources.device)
    torch.manual_seed(spec.train.seed)  # the same initial weights on every rank
    dataset, info = build_dataset(spec, data_dir)
    model = apply_strategy(build_model(spec.model, info), spec.strategy, d, spec.fsdp)
    optimizer = build_optimizer(spec.optimizer, model)
    torch.manual_seed(spec.train.seed + d.rank)  # then per-rank randomness
    # drop_last keeps every rank's batch the same size, so the mean of rank means is the global mean.
    sampler = DistributedSampler(dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                                 seed=spec.train.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=spec.data.batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"dataset of {len(dataset)} samples gives no full batch of {spec.data.batch_size} "
                         f"per rank over {d.world_size} ranks")
    reporter = Reporter(reporter_path, enabled=d.is_main)
    if d.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[trainjobs] {spec.strategy} on {d.world_size} x {d.device.type}: {spec.model.type} with "
              f"{n_params:,} parameters, {len(dataset):,} samples, global batch "
              f"{spec.data.batch_size * d.world_size}, {spec.train.max_steps} steps", flush=True)
    fault = spec.fault_injection
    max_steps, log_every = spec.train.max_steps, spec.train.log_every
    global_batch = spec.data.batch_size * d.world_size
    grad_clip = spec.optimizer.grad_clip or math.inf

    step, epoch, loss_value = 0, 0, float("nan")
    t_start = t_last = time.perf_counter()
    last_logged = 0
    while step < max_steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            if fault and step == fault.raise_at_step and d.rank == fault.rank:
                raise RuntimeError(fault.message)
            inputs, targets = inputs.to(d.device, non_blocking=True), targets.to(d.device, non_blocking=True)
            lr = lr_at(spec.optimizer, step, max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = loss_fn(info.task, model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
            step += 1
            if step % log_every == 0 or step == max_steps:
                loss_value = mean_across_ranks(loss)  # a collective, so only on log steps
                now = time.perf_counter()
                steps = step - last_logged
                metrics = {
                    "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                    "samples_per_s": steps * global_batch / (now - t_last),
                    "step_time_s": (now - t_last) / steps, "peak_mem_mb": peak_memory_mb(d.device),
                }
                if info.task == "lm":
                    metrics["tokens_per_s"] = metrics["samples_per_s"] * info.tokens_per_sample
                reporter.log(step, metrics)
                if d.is_main:
                    print(f"step {step}/{max_steps} loss {loss_value:.6f} lr {lr:.3g} "
                          f"grad_norm {metrics['grad_norm']:.4f} samples/s {metrics['samples_per_s']:.0f}",
                          flush=True)
                t_last, last_logged = now, step
            if step >= max_steps:
                break
        epoch += 1

    wall = time.perf_counter() - t_start
    summary = {
        "final_loss": loss_value, "steps": step, "epochs": epoch, "world_size": d.world_size,
        "global_batch": global_batch, "wall_time_s": wall, "samples_per_s": step * global_batch / wall,
        "peak_mem_mb": peak_memory_mb(d.device), "device": d.device.type,
    }
    if info.task == "lm":
        summary["tokens_per_s"] = summary["samples_per_s"] * info.tokens_per_sample
    reporter.summary(summary)
    if d.is_main:
        print(f"[trainjobs] done: {step} steps in {wall:.2f}s, final loss {loss_value:.6f}", flush=True)
    reporter.close()


@record
def main() -> None:
    run_dir = Path(sys.argv[1])
    spec = JobSpec.model_validate_json((run_dir / SPEC_FILE).read_text())
    data_dir = Path(os.environ.get("TRAINJOBS_DATA_DIR", "./trainjobs-data"))
    train(spec, data_dir, Path(os.environ.get(METRICS_FILE_ENV) or run_dir / "metrics.jsonl"))
    cleanup_and_exit(0)


if __name__ == "__main__":
    main()
