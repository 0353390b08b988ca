"""PyTorch Lightning 2.x (`lightning.pytorch` or `pytorch_lightning`): what its loggers get, progress, summary, stop.

- Metrics: _LoggerConnector.log_metrics is the one call through which every logger (TensorBoardLogger, CSVLogger,
  MLFlowLogger, ...) gets its scalars; wrapped, it gives the same names and steps (Lightning's own: the `step` a
  module logs, else `_batches_that_stepped`, with `epoch` added), even with logger=False, where Lightning itself
  drops them. Its loggers' own TensorBoard or MLflow calls inside are muted (one series per name).
- The fit loop's on_run_start (total steps: estimated_stepping_batches, when finite; the step it resumed at),
  the training epoch loop's advance (the live step, at most once a second; the stop on PREEMPT_SIGNAL) and the fit
  loop's on_run_end (the summary: callback_metrics, global_step, steps/s) are wrapped, not hooked by a Callback:
  Lightning calls every hook of every Callback on every step (~8 us a step measured for one that does nothing, 1% of
  a tiny model's step), a wrapper costs one call.
- Preemption: SIGTERM and PREEMPT_SIGNAL (the supervisor's "checkpoint and exit") set a flag; at a step every rank
  agreed on (stop.py) Lightning's own received_sigterm is set on all of them, and Lightning's SIGTERM path stops the
  run (SIGTERMException). Lightning's own SIGTERM handler is replaced for it where the script added none to it (it
  broadcasts from inside the handler: see Run.start). On it, `last.ckpt` is saved into the ModelCheckpoint's dirpath
  when that lies in TRAINJOBS_CHECKPOINT_DIR (and, for PREEMPT_SIGNAL, rank 0 reports `preempted`: the job goes back
  to the queue); a later fit() there with no ckpt_path resumes from it ("last").
"""

import functools
import importlib
import math
import os
import signal
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from trainjobs.capture.sink import Sink, say
from trainjobs.capture.stop import StopOnSignal
from trainjobs.runenv import CHECKPOINT_DIR_ENV, PREEMPT_SIGNAL

SOURCE = "lightning"


def patch(module: ModuleType, sink: Sink) -> None:
    root = module.__name__.removesuffix(".trainer.trainer")  # lightning.pytorch | pytorch_lightning
    connector = importlib.import_module(f"{root}.trainer.connectors.logger_connector.logger_connector")
    fit_loop = importlib.import_module(f"{root}.loops.fit_loop")._FitLoop
    epoch_loop = importlib.import_module(f"{root}.loops.training_epoch_loop")._TrainingEpochLoop
    call = importlib.import_module(f"{root}.trainer.call")
    sigterm = getattr(importlib.import_module(f"{root}.utilities.exceptions"), "SIGTERMException", ())
    run = Run(sink, sigterm)

    log_metrics = connector._LoggerConnector.log_metrics

    @functools.wraps(log_metrics)
    def logged(self: Any, metrics: Any, step: int | None = None) -> None:
        sink.guard(SOURCE, record, sink, self.trainer, metrics, step)
        with sink.muted():
            return log_metrics(self, metrics, step)

    connector._LoggerConnector.log_metrics = logged
    after(fit_loop, "on_run_start", lambda loop: sink.guard(SOURCE, run.start, loop.trainer))
    after(fit_loop, "on_run_end", lambda loop: sink.guard(SOURCE, run.end, loop.trainer))
    after(epoch_loop, "advance", lambda loop: run.stepped(loop.trainer))

    interrupt = call._interrupt

    @functools.wraps(interrupt)
    def interrupted(trainer: Any, exception: BaseException) -> None:
        if isinstance(exception, sigterm):
            sink.guard("preemption", run.save, trainer)
        return interrupt(trainer, exception)

    call._interrupt = interrupted

    fit = module.Trainer.fit

    @functools.wraps(fit)
    def fit_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 5 and kwargs.get("ckpt_path") is None and sink.guard(SOURCE, resumable, self, sink):
            kwargs["ckpt_path"] = "last"
        return fit(self, *args, **kwargs)

    module.Trainer.fit = fit_


def after(owner: type, name: str, then: Callable[[Any], Any]) -> None:
    """owner.name, then `then(self)` once it returned."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        then(self)
        return result

    setattr(owner, name, wrapper)


def record(sink: Sink, trainer: Any, metrics: Any, step: int | None) -> None:
    """What log_metrics will hand its loggers, as it computes it."""
    if not sink.rank0 or not metrics:
        return
    metrics = dict(metrics)
    if step is None:
        if (given := metrics.pop("step", None)) is not None:
            step = int(given)
        else:
            metrics.setdefault("epoch", trainer.current_epoch)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
    sink.scalars(step, metrics)


class Run:
    """One fit() at a time: its start, its steps, its end or its stop."""

    def __init__(self, sink: Sink, sigterm: Any):
        self.sink, self.sigterm = sink, sigterm
        self.started, self.first_step = time.monotonic(), 0
        self.stop = StopOnSignal()
        self.preempt = False

    def start(self, trainer: Any) -> None:
        self.started, self.first_step, self.preempt = time.monotonic(), trainer.global_step, False
        total = trainer.estimated_stepping_batches
        if isinstance(total, int) or (isinstance(total, float) and math.isfinite(total)):
            self.sink.total_steps(int(total))
        self.sink.resumed(trainer.global_step)
        # NOTE: Lightning's own SIGTERM handler (registered as fit() began) broadcasts on the default process group from
        # inside the handler: a rank signalled during a gradient all-reduce then pairs the wrong collectives, and DDP
        # dies (measured: 2 gloo ranks, SIGTERM through torchrun: "Connection closed by peer", no checkpoint). Where
        # it is Lightning's alone (the script added none), ours replaces it: a flag, and a step the ranks agree on.
        # Lightning's teardown puts back the handlers it found.
        self.stop = StopOnSignal()
        current = signal.getsignal(signal.SIGTERM)
        signals = (signal.SIGTERM, PREEMPT_SIGNAL) if lightning_s_alone(current, trainer) else (PREEMPT_SIGNAL,)
        self.sink.guard("preemption", self.stop.install, signals, replacing=(current,))

    def stepped(self, trainer: Any) -> None:
        sink, step = self.sink, trainer.global_step  # a property chain (~0.5 us): read once
        if sink.rank0 and SOURCE not in sink.off:
            sink.guard(SOURCE, sink.beat, step)
        # NOTE: set on every rank after the step they agreed on, so all stop at the next batch (Lightning broadcasts
        # rank 0's flag under DDP): set from the handler, each rank would stop at its own step, and DDP hang.
        if self.stop.handling and sink.guard("preemption", self.stop.due, step):
            self.preempt = self.stop.preempt
            trainer._signal_connector.received_sigterm = True

    def end(self, trainer: Any) -> None:
        self.sink.guard("preemption", self.stop.close)
        if not self.sink.rank0:
            return
        self.sink.reached(trainer.global_step)
        elapsed, steps = time.monotonic() - self.started, trainer.global_step - self.first_step
        final: dict[str, Any] = dict(trainer.callback_metrics)
        final.update(global_step=trainer.global_step, epoch=trainer.current_epoch, train_runtime=elapsed,
                     train_steps_per_second=steps / elapsed if elapsed > 0 else None)
        self.sink.summary(final)

    def save(self, trainer: Any) -> None:
        """On SIGTERMException (Lightning's SIGTERM, or our PREEMPT_SIGNAL): last.ckpt where fit() resumes from."""
        why = "preempted" if self.preempt else "SIGTERM"
        self.sink.interrupted()  # not done: no summary
        if (folder := checkpoint_dir(trainer)) is not None:
            path = os.path.join(folder, "last.ckpt")
            trainer.save_checkpoint(path)  # every rank: it ends in a barrier
            if self.sink.rank0:
                say(f"{why}: saved {path} at step {trainer.global_step}; the next attempt resumes from it")
        if self.preempt:
            self.sink.preempted(trainer.global_step)


def lightning_s_alone(handler: Any, trainer: Any) -> bool:
    """SIGTERM's handler is the one Lightning's signal connector made, composing none of the script's."""
    connector = getattr(trainer, "_signal_connector", None)
    found = getattr(handler, "signal_handlers", None)
    return (connector is not None and isinstance(found, list) and bool(found)
            and all(getattr(h, "__self__", None) is connector for h in found))


def checkpoint_dir(trainer: Any) -> str | None:
    """The ModelCheckpoint's dirpath when it lies in TRAINJOBS_CHECKPOINT_DIR; else None (not ours to touch)."""
    root, callback = os.environ.get(CHECKPOINT_DIR_ENV), getattr(trainer, "checkpoint_callback", None)
    dirpath = getattr(callback, "dirpath", None)
    if not root or not dirpath:
        return None
    root, dirpath = os.path.realpath(root), os.path.realpath(dirpath)
    return dirpath if dirpath == root or dirpath.startswith(root + os.sep) else None


def resumable(trainer: Any, sink: Sink) -> bool:
    """A last*.ckpt waits in the checkpoint dir (a previous attempt's): fit() resumes from it."""
    if (folder := checkpoint_dir(trainer)) is None or not os.path.isdir(folder):
        return False
    found = sorted(n for n in os.listdir(folder) if n.startswith("last") and n.endswith(".ckpt"))
    if found and sink.rank0:
        say(f"resuming from {os.path.join(folder, found[-1])} (fit(ckpt_path='last'); pass ckpt_path to choose)")
    return bool(found)
