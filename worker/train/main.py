"""The training entry point under torchrun: init, build, resume, train, save, close."""

import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainjobs.runenv import (
    ARTIFACTS_DIR_ENV,
    ATTEMPT_ENV,
    CHECKPOINT_DIR_ENV,
    METRICS_FILE,
    METRICS_FILE_ENV,
    SPEC_FILE,
    Reporter,
    env_path,
)
from trainjobs.spec import JobSpec
from worker.train.checkpoint import Checkpointer, Position, save_model
from worker.train.data import BatchStream, DataInfo, build_dataset, split_eval
from worker.train.distributed import cleanup_and_exit, init_distributed, mean_across_ranks, peak_memory_mb
from worker.train.flops import flops_per_sample, mfu, peak_flops
from worker.train.models import build_model, loss_fn
from worker.train.optim import build_optimizer, lr_at
from worker.train.preempt import Preemption
from worker.train.strategies import apply_strategy


def train(spec: JobSpec, data_dir: Path, reporter_path: Path | None) -> None:
    d = init_distributed(spec.resources.device)
    preemption = Preemption()  # from here on, the supervisor's signal is acted on rather than ignored
    cfg = spec.train
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    dataset, info = build_dataset(spec, data_dir)
    train_set, eval_set = split_eval(dataset, cfg.eval_fraction if cfg.eval_every else None)
    base_mem_mb = peak_memory_mb(d.device)  # before the model: what training adds is the peak minus this
    raw_model = build_model(spec.model, info)
    n_params = sum(p.numel() for p in raw_model.parameters())
    embedding_params = sum(m.weight.numel() for m in raw_model.modules() if isinstance(m, torch.nn.Embedding))
    model = apply_strategy(raw_model, spec.strategy, d, spec.fsdp)
    optimizer = build_optimizer(spec.optimizer, model)
    torch.manual_seed(cfg.seed + d.rank)  # then per-rank randomness

    checkpoints = Checkpointer(env_path(CHECKPOINT_DIR_ENV), d, every=cfg.checkpoint_every,
                               keep=cfg.keep_checkpoints)
    latest = [checkpoints.latest() if d.is_main else None]
    dist.broadcast_object_list(latest, src=0)  # rank 0 decides, so every rank loads the same one
    position = checkpoints.load(latest[0], model, optimizer) if latest[0] else Position()
    resumed_from = position.step if latest[0] else None
    stream = BatchStream(train_set, batch_size=spec.data.batch_size, rank=d.rank, world_size=d.world_size,
                         seed=cfg.seed, epoch=position.epoch, batches_in_epoch=position.batches_in_epoch)
    evaluate = Evaluator(eval_set, spec, info, d) if eval_set is not None else None

    # Local rank 0 of each node reports (a gang keeps a series per node); only global rank 0 the summary.
    reporter = Reporter(reporter_path, enabled=d.local_rank == 0)
    accum, max_steps = cfg.grad_accum_steps, cfg.max_steps
    global_batch = spec.data.batch_size * d.world_size * accum
    peak = peak_flops(torch.cuda.get_device_name(d.device)) if d.device.type == "cuda" else None
    sample_flops = flops_per_sample(spec.model, n_params, embedding_params)
    if d.is_main:
        print(f"[trainjobs] {spec.strategy} on {d.world_size} x {d.device.type}: {spec.model.type} with "
              f"{n_params:,} parameters, {len(train_set):,} training samples, global batch {global_batch}"
              f"{f' ({accum} micro-batches)' if accum > 1 else ''}, {max_steps} steps", flush=True)
        if resumed_from is not None:
            print(f"[trainjobs] resumed from checkpoint {latest[0].name} at step {resumed_from}", flush=True)
    if resumed_from is not None:
        reporter.resumed(resumed_from)  # each node's, for its attempt row
    fault = spec.fault_injection
    attempt = int(os.environ.get(ATTEMPT_ENV, "1"))
    fault_armed = fault is not None and d.rank == fault.rank and fault.attempt in (None, attempt)
    grad_clip = spec.optimizer.grad_clip or math.inf

    step, loss_value, metrics = position.step, None, {}
    t_start = t_last = time.perf_counter()
    last_logged = step
    while step < max_steps:
        if fault_armed and step == fault.raise_at_step:
            raise RuntimeError(fault.message)
        lr = lr_at(spec.optimizer, step, max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=d.device)
        for micro in range(accum):
            inputs, targets = next(stream)
            inputs, targets = inputs.to(d.device, non_blocking=True), targets.to(d.device, non_blocking=True)
            with gradient_sync(model, enabled=micro == accum - 1):
                loss = loss_fn(info.task, model(inputs), targets) / accum
                loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        step += 1
        metrics = {}
        if step % cfg.log_every == 0 or step == max_steps:
            loss_value = mean_across_ranks(step_loss)  # a collective, so only on log steps
            now = time.perf_counter()
            steps = step - last_logged
            samples_per_s = steps * global_batch / (now - t_last)
            metrics = {"loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(), "samples_per_s": samples_per_s,
                       "step_time_s": (now - t_last) / steps, "peak_mem_mb": peak_memory_mb(d.device)}
            if info.task == "lm":
                metrics["tokens_per_s"] = samples_per_s * info.tokens_per_sample
            if peak:
                metrics["mfu"] = mfu(samples_per_s, sample_flops, peak, d.world_size)
            if d.is_main:
                print(f"step {step}/{max_steps} loss {loss_value:.6f} lr {lr:.3g} grad_norm "
                      f"{metrics['grad_norm']:.4f} samples/s {samples_per_s:.0f}", flush=True)
            t_last, last_logged = now, step
        paused = time.perf_counter()  # evaluation and checkpoints do not count against throughput
        if evaluate and (step % cfg.eval_every == 0 or step == max_steps):
            metrics["eval_loss"] = evaluate(model)
            if d.is_main:
                print(f"step {step}/{max_steps} eval_loss {metrics['eval_loss']:.6f}", flush=True)
        if metrics:
            reporter.log(step, metrics)
        if checkpoints.due(step):
            checkpoints.save(model, optimizer, Position(step, stream.epoch, stream.batches_in_epoch))
        t_last += time.perf_counter() - paused
        if step < max_steps and preemption.due(step):  # every rank agrees on the step
            hand_back(checkpoints, model, optimizer, Position(step, stream.epoch, stream.batches_in_epoch),
                      reporter, d, saved=checkpoints.due(step))
            return
    preemption.close()

    wall = time.perf_counter() - t_start
    train_peak_mb = peak_memory_mb(d.device)  # before the gather of the full model for the file
    model_file = save_model(model, d, env_path(ARTIFACTS_DIR_ENV))
    done = step - position.step
    summary = {
        "final_loss": loss_value, "steps": step, "epochs": stream.epoch, "world_size": d.world_size,
        "global_batch": global_batch, "wall_time_s": wall, "samples_per_s": done * global_batch / wall,
        "peak_mem_mb": train_peak_mb, "base_mem_mb": base_mem_mb, "device": d.device.type,
        "parameters": n_params,
        "resumed_from_step": resumed_from,
    }
    if info.task == "lm":
        summary["tokens_per_s"] = summary["samples_per_s"] * info.tokens_per_sample
    if peak:
        summary["mfu"] = mfu(summary["samples_per_s"], sample_flops, peak, d.world_size)
    if "eval_loss" in metrics:
        summary["eval_loss"] = metrics["eval_loss"]
    if model_file:
        summary["model_file"] = model_file.name
    if d.is_main:
        reporter.summary(summary)
        print(f"[trainjobs] done: {step} steps in {wall:.2f}s, final loss {loss_value}", flush=True)
    reporter.close()


def hand_back(checkpoints: Checkpointer, model, optimizer, position: Position, reporter: Reporter, d, *,
              saved: bool) -> None:
    """Preempted: checkpoint where training stands (unless this step just did), say so, and stop; no summary."""
    if checkpoints.root is not None and not saved:
        checkpoints.save(model, optimizer, position)
    reporter.preempted(position.step)
    if d.is_main:
        where = "checkpoint saved" if checkpoints.root is not None else "no checkpoint dir: progress lost"
        print(f"[trainjobs] preempted at step {position.step}: {where}", flush=True)
    reporter.close()


def gradient_sync(model: torch.nn.Module, *, enabled: bool):
    """Skip the gradient all-reduce on inner micro-batches: DDP's no_sync, FSDP2's requires_gradient_sync."""
    if hasattr(model, "no_sync"):
        return contextlib.nullcontext() if enabled else model.no_sync()
    model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


class Evaluator:
    """Mean loss over up to eval_batches batches per rank of the held-out split, on every rank."""

    def __init__(self, dataset: Dataset, spec: JobSpec, info: DataInfo, d):
        sampler = DistributedSampler(dataset, num_replicas=d.world_size, rank=d.rank, shuffle=False, drop_last=True)
        self.loader = DataLoader(dataset, batch_size=spec.data.batch_size, sampler=sampler, drop_last=True)
        if len(self.loader) == 0:
            raise ValueError(f"the held-out split ({len(dataset)} samples, train.eval_fraction "
                             f"{spec.train.eval_fraction}) gives no batch of {spec.data.batch_size} per rank")
        self.batches, self.task, self.device = spec.train.eval_batches, info.task, d.device

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        model.eval()
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        for i, (inputs, targets) in enumerate(self.loader):
            if i == self.batches:
                break
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            total[0] += loss_fn(self.task, model(inputs), targets).double()
            total[1] += 1
        model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()


@record
def main() -> None:
    run_dir = Path(sys.argv[1])
    spec = JobSpec.model_validate_json((run_dir / SPEC_FILE).read_text())
    data_dir = Path(os.environ.get("TRAINJOBS_DATA_DIR", "./trainjobs-data"))
    train(spec, data_dir, Path(os.environ.get(METRICS_FILE_ENV) or run_dir / METRICS_FILE))
    cleanup_and_exit(0)


if __name__ == "__main__":
    main()
