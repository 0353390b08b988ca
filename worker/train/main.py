"""The training entry point under torchrun: init, build, resume, train, save, close."""

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainjobs.runenv import (
    ARTIFACTS_DIR_ENV,
    ATTEMPT_ENV,
    CHECKPOINT_DIR_ENV,
    DATA_DIR_ENV,
    INIT_FROM_ENV,
    METRICS_FILE,
    METRICS_FILE_ENV,
    SPEC_FILE,
    Reporter,
    env_path,
)
from trainjobs.spec import JobSpec
from worker.train import own_time
from worker.train.checkpoint import Checkpointer, Position, load_weights, save_model
from worker.train.data import BatchStream, DataInfo, build_dataset, split_eval
from worker.train.distributed import Dist, cleanup_and_exit, init_distributed, mean_across_ranks, peak_memory_mb
from worker.train.fast import autocast_dtype, forward_context, matmul_precision, set_matmul_precision, use_compile
from worker.train.flops import flops_per_sample
from worker.train.models import build_model, loss_fn
from worker.train.optim import build_optimizer, lr_at
from worker.train.own_time import OwnTime
from worker.train.perf import DeviceUse, Speed
from worker.train.preempt import Preemption
from worker.train.strategies import apply_strategy


class NonFiniteLoss(ValueError):
    """The loss became NaN or infinite: training diverged (the job's error names the step)."""


def hang_forever() -> None:
    """fault_injection.hang_at_step: this rank blocks (its peers then wait in the next collective)."""
    print(f"rank {os.environ.get('RANK')}: injected hang", flush=True)
    while True:
        time.sleep(3600)


def train(spec: JobSpec, data_dir: Path, reporter_path: Path | None) -> None:
    """Build, resume, train to max_steps (or to a preemption), save and summarise, on every rank."""
    d = init_distributed(spec.resources.device)
    preemption = Preemption()  # from here on, the supervisor's signal is acted on rather than ignored
    run = build(spec, data_dir, reporter_path, d)
    announce(run)
    cfg, window = spec.train, Window(run.position.step)
    step, loss_value, metrics, diverged_at = run.position.step, None, {}, None
    while step < cfg.max_steps:
        if run.fault_armed and step == spec.fault_injection.raise_at_step:
            raise RuntimeError(spec.fault_injection.message)
        if run.fault_armed and step == spec.fault_injection.hang_at_step:
            hang_forever()
        logs = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps
        lr, step_loss, grad_norm = train_step(run, step, norm=logs)
        step += 1
        metrics = {}
        if logs:
            loss_value = mean_across_ranks(step_loss)  # a collective, so only on log steps
            if not math.isfinite(loss_value) and diverged_at is None:
                diverged_at = step
                check_finite(run, loss_value, step)
            metrics = step_metrics(run, window, step, loss=loss_value, lr=lr, grad_norm=grad_norm.item())
        with window.paused():  # evaluation and checkpoints do not count against throughput
            if run.evaluate and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                metrics["eval_loss"] = run.evaluate(run.model)
                if d.is_main:
                    print(f"step {step}/{cfg.max_steps} eval_loss {metrics['eval_loss']:.6f}", flush=True)
            if metrics:
                run.reporter.log(step, metrics)
            if run.checkpoints.due(step):
                run.checkpoints.save(run.model, run.optimizer, run.position_at(step))
        if step < cfg.max_steps and preemption.due(step):  # every rank agrees on the step
            hand_back(run.checkpoints, run.model, run.optimizer, run.position_at(step), run.reporter, d,
                      saved=run.checkpoints.due(step))
            return
    preemption.close()
    finish(run, step=step, wall=window.wall(), loss_value=loss_value, metrics=metrics, diverged_at=diverged_at)


@dataclass
class Run:
    """What one rank trains with: built once by build(), then stepped."""

    spec: JobSpec
    d: Dist
    info: DataInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    stream: BatchStream
    checkpoints: Checkpointer
    evaluate: "Evaluator | None"
    reporter: Reporter
    position: Position  # where this attempt started (a resumed checkpoint's, else step 0)
    resumed_from: Path | None  # the checkpoint it resumed from
    train_samples: int
    n_params: int
    speed: Speed  # throughput and MFU from a window's steps and seconds
    device_use: DeviceUse  # the GPU as NVML sees it (CUDA only)
    autocast: torch.dtype | None  # DDP's forward precision on CUDA
    compiled: bool
    base_mem_mb: float  # before the model was built: what training adds is the peak minus this
    fault_armed: bool
    own_time: OwnTime  # this rank's data and forward time, gathered per log window (stragglers)

    @property
    def global_batch(self) -> int:
        return self.spec.data.batch_size * self.d.world_size * self.spec.train.grad_accum_steps

    def position_at(self, step: int) -> Position:
        return Position(step, self.stream.epoch, self.stream.batches_in_epoch)


def build(spec: JobSpec, data_dir: Path, reporter_path: Path | None, d: Dist) -> Run:
    """The data, the model under its strategy, the optimizer, and the newest complete checkpoint loaded."""
    cfg = spec.train
    set_matmul_precision(d.device)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    dataset, info = build_dataset(spec, data_dir)
    train_set, eval_set = split_eval(dataset, cfg.eval_fraction if cfg.eval_every else None)
    base_mem_mb = peak_memory_mb(d.device)
    raw_model = build_model(spec.model, info)
    n_params = sum(p.numel() for p in raw_model.parameters())
    embedding_params = sum(m.weight.numel() for m in raw_model.modules() if isinstance(m, torch.nn.Embedding))
    compiled = use_compile(spec, d.device)
    model = apply_strategy(raw_model, spec.strategy, d, spec.fsdp,
                           compile_backend=cfg.compile_backend if compiled else None)
    optimizer = build_optimizer(spec.optimizer, model, d.device)
    torch.manual_seed(cfg.seed + d.rank)  # then per-rank randomness

    checkpoints = Checkpointer(env_path(CHECKPOINT_DIR_ENV), d, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints)
    latest = checkpoints.agreed_latest()  # every rank the same one, each under its own node's root
    position = checkpoints.load(latest, model, optimizer) if latest else Position()
    if latest is None and (source := env_path(INIT_FROM_ENV)) is not None:  # its own checkpoint wins (a retry)
        load_weights(model, source)
        if d.is_main:
            print(f"[trainjobs] initialised the model from {source}", flush=True)
    stream = BatchStream(train_set, batch_size=spec.data.batch_size, rank=d.rank, world_size=d.world_size,
                         seed=cfg.seed, epoch=position.epoch, batches_in_epoch=position.batches_in_epoch,
                         pin_memory=d.device.type == "cuda")
    fault = spec.fault_injection
    attempt = int(os.environ.get(ATTEMPT_ENV, "1"))
    return Run(
        spec=spec, d=d, info=info, model=model, optimizer=optimizer, stream=stream, checkpoints=checkpoints,
        evaluate=Evaluator(eval_set, spec, info, d) if eval_set is not None else None,
        # Local rank 0 of each node reports (a gang keeps a series per node); only global rank 0 the summary.
        reporter=Reporter(reporter_path, enabled=d.local_rank == 0),
        position=position, resumed_from=latest, train_samples=len(train_set), n_params=n_params,
        speed=Speed(global_batch=spec.data.batch_size * d.world_size * cfg.grad_accum_steps,
                    tokens_per_sample=info.tokens_per_sample, world_size=d.world_size,
                    sample_flops=flops_per_sample(spec.model, n_params, embedding_params),
                    device_name=torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else None,
                    precision=matmul_precision(spec, d.device)),
        device_use=DeviceUse(d.device, d.local_rank), autocast=autocast_dtype(spec, d.device), compiled=compiled,
        base_mem_mb=base_mem_mb,
        fault_armed=fault is not None and d.rank == fault.rank and fault.attempt in (None, attempt),
        own_time=OwnTime(d.device, enabled=spec.straggler.enabled),
    )


def announce(run: Run) -> None:
    """One line for the log (global rank 0), and the resumed step for the attempt row (each node's)."""
    spec, accum = run.spec, run.spec.train.grad_accum_steps
    if run.d.is_main:
        print(f"[trainjobs] {spec.strategy} on {run.d.world_size} x {run.d.device.type}: {spec.model.type} with "
              f"{run.n_params:,} parameters, {run.train_samples:,} training samples, global batch "
              f"{run.global_batch}{f' ({accum} micro-batches)' if accum > 1 else ''}, {spec.train.max_steps} steps"
              f"{f', compiled ({spec.train.compile_backend})' if run.compiled else ''}"
              f"{', bf16 autocast' if run.autocast is not None else ''}", flush=True)
        if run.resumed_from is not None:
            print(f"[trainjobs] resumed from checkpoint {run.resumed_from.name} at step {run.position.step}",
                  flush=True)
    if run.resumed_from is not None:
        run.reporter.resumed(run.position.step)


def train_step(run: Run, step: int, *, norm: bool = True) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """One optimizer step over grad_accum_steps micro-batches: (lr, the step's loss, the gradient norm).

    Without optimizer.grad_clip the norm is only reported: it is taken where `norm` asks (log steps), not every
    step (a pass over every gradient and, under FSDP, a collective).
    """
    spec, d = run.spec, run.d
    lr = lr_at(spec.optimizer, step, spec.train.max_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    accum = spec.train.grad_accum_steps
    step_loss = torch.zeros((), device=d.device)
    slow_s = spec.fault_injection.sleep_per_step_s if run.fault_armed else None
    for micro in range(accum):
        with gradient_sync(run.model, enabled=micro == accum - 1):
            with run.own_time.measure():  # up to backward: this rank's own time, before it waits for the others
                inputs, targets = next(run.stream)
                inputs, targets = inputs.to(d.device, non_blocking=True), targets.to(d.device, non_blocking=True)
                if slow_s and micro == 0:
                    time.sleep(slow_s)  # fault_injection.sleep_per_step_s: a straggler on purpose
                with forward_context(run.autocast):
                    loss = loss_fn(run.info.task, run.model(inputs), targets) / accum
            loss.backward()
        step_loss += loss.detach()
    grad_norm = None
    if norm or spec.optimizer.grad_clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), spec.optimizer.grad_clip or math.inf)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
    run.optimizer.step()
    return lr, step_loss, grad_norm


def check_finite(run: Run, loss_value: float, step: int) -> None:
    """A loss that became NaN or infinite fails the run, naming the step (unless train.stop_on_nan is off).

    The value is a mean across the ranks, the same on every rank: all raise, or none does.
    """
    if run.spec.train.stop_on_nan:
        raise NonFiniteLoss(f"loss is {_named(loss_value)} at step {step}")
    if run.d.is_main:
        print(f"[trainjobs] loss is {_named(loss_value)} at step {step}; train.stop_on_nan is false: "
              "training goes on (non-finite points are not stored)", flush=True)


def step_metrics(run: Run, window: "Window", step: int, *, loss: float, lr: float, grad_norm: float) -> dict:
    """The metrics of a log step, throughput over the steps since the last one; printed by global rank 0."""
    steps, seconds = window.close(step)
    speed = run.speed.figures(steps, seconds)
    metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **speed, "peak_mem_mb": peak_memory_mb(run.d.device)}
    if run.d.world_size > 1 and run.own_time.enabled:  # a collective: every rank gathers; global rank 0 reports
        metrics.update({f"{own_time.SERIES}{r}": t for r, t in enumerate(run.own_time.gather(steps))})
    with window.paused():
        run.device_use.sample()
    if run.d.is_main:
        mfu = f" mfu {100 * speed['mfu']:.1f}%" if "mfu" in speed else ""
        print(f"step {step}/{run.spec.train.max_steps} loss {loss:.6f} lr {lr:.3g} grad_norm {grad_norm:.4f} "
              f"samples/s {speed['samples_per_s']:.0f}{mfu}", flush=True)
    return metrics


def finish(run: Run, *, step: int, wall: float, loss_value: float | None, metrics: dict,
           diverged_at: int | None) -> None:
    """Save the final model, write the summary (global rank 0) and close the reporter."""
    d = run.d
    train_peak_mb = peak_memory_mb(d.device)  # before the gather of the full model for the file
    model_file = save_model(run.model, d, env_path(ARTIFACTS_DIR_ENV))
    summary = {
        "final_loss": loss_value, "steps": step, "epochs": run.stream.epoch, "world_size": d.world_size,
        "global_batch": run.global_batch, "wall_time_s": wall,
        **run.speed.figures(max(1, step - run.position.step), wall), **run.speed.constants(),
        "peak_mem_mb": train_peak_mb, "base_mem_mb": run.base_mem_mb, "device": d.device.type,
        "parameters": run.n_params, "compiled": run.compiled,
        "resumed_from_step": run.position.step if run.resumed_from is not None else None,
        **run.device_use.summary(),
    }
    run.device_use.close()
    if "eval_loss" in metrics:
        summary["eval_loss"] = metrics["eval_loss"]
    if diverged_at is not None:  # train.stop_on_nan false: it went on; say where the loss first went non-finite
        summary["diverged_at_step"] = diverged_at
    if model_file:
        summary["model_file"] = model_file.name
    if d.is_main:
        # NOTE: a diverged run's final loss is NaN, which strict JSON (the database, the API) cannot carry.
        run.reporter.summary({k: None if isinstance(v, float) and not math.isfinite(v) else v
                              for k, v in summary.items()})
        print(f"[trainjobs] done: {step} steps in {wall:.2f}s, final loss {loss_value}", flush=True)
    run.reporter.close()


class Window:
    """Wall time between log steps, for throughput; time spent paused() (evaluation, checkpoints) is left out."""

    def __init__(self, step: int):
        self.start = self.last = time.perf_counter()
        self.last_step = step

    def close(self, step: int) -> tuple[int, float]:
        """(steps, seconds) since the last close, and a new window from here."""
        now = time.perf_counter()
        steps, seconds = step - self.last_step, now - self.last
        self.last, self.last_step = now, step
        return steps, seconds

    @contextlib.contextmanager
    def paused(self):
        began = time.perf_counter()
        yield
        self.last += time.perf_counter() - began

    def wall(self) -> float:
        return time.perf_counter() - self.start


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


def _named(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


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
        self.autocast = autocast_dtype(spec, d.device)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        model.eval()
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        for i, (inputs, targets) in enumerate(self.loader):
            if i == self.batches:
                break
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with forward_context(self.autocast):
                total[0] += loss_fn(self.task, model(inputs), targets).double()
            total[1] += 1
        model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()


@record
def main() -> None:
    run_dir = Path(sys.argv[1])
    spec = JobSpec.model_validate_json((run_dir / SPEC_FILE).read_text())
    data_dir = Path(os.environ.get(DATA_DIR_ENV, "./trainjobs-data"))
    train(spec, data_dir, Path(os.environ.get(METRICS_FILE_ENV) or run_dir / METRICS_FILE))
    cleanup_and_exit(0)


if __name__ == "__main__":
    main()
