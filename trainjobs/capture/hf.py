"""Hugging Face transformers' Trainer: a TrainerCallback every Trainer (and subclass) gets, whatever report_to says.

- on_log: the numbers Trainer logs (`loss`, `grad_norm`, `learning_rate`, `epoch`, `eval_*`, and at the end
  `train_runtime`, `train_samples_per_second`, `train_loss`, ...), under those names, at state.global_step. Its own
  TensorBoard and MLflow callbacks run muted meanwhile (they log the same numbers as `train/loss`, ...).
- on_train_begin: total steps (state.max_steps) and, when it resumed, the step it resumed at.
- on_step_end: the live step (at most once a second), and the stop on SIGTERM or PREEMPT_SIGNAL: every rank
  agrees on a step (stop.py), sets control.should_save and should_training_stop, so Trainer saves checkpoint-N and
  returns; on PREEMPT_SIGNAL, once saved (on_save), rank 0 reports `preempted` (the job goes back to the queue).
- on_train_end: the summary (the last value of every logged name, global_step).
- train() with no resume_from_checkpoint, whose output_dir lies in TRAINJOBS_CHECKPOINT_DIR and holds a
  checkpoint-N: resumes from the newest (a retried or handed-back attempt keeps its steps).
"""

import functools
import os
from types import ModuleType
from typing import Any

from trainjobs.capture.sink import Sink, say
from trainjobs.capture.stop import StopOnSignal
from trainjobs.runenv import CHECKPOINT_DIR_ENV

SOURCE = "transformers"


def patch(module: ModuleType, sink: Sink) -> None:
    from transformers import trainer_callback  # imported already: transformers.trainer imports it

    callback_class = make_callback(trainer_callback.TrainerCallback, sink)
    trainer = module.Trainer
    init = trainer.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sink.guard(SOURCE, self.add_callback, callback_class())

    trainer.__init__ = __init__

    train = trainer.train

    @functools.wraps(train)
    def train_(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is None:
            resume_from_checkpoint = sink.guard(SOURCE, last_checkpoint, self, sink)
        return train(self, resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_

    on_log = trainer_callback.CallbackHandler.on_log

    @functools.wraps(on_log)
    def on_log_(self: Any, *args: Any, **kwargs: Any) -> Any:
        with sink.muted():
            return on_log(self, *args, **kwargs)

    trainer_callback.CallbackHandler.on_log = on_log_


def last_checkpoint(trainer: Any, sink: Sink) -> str | None:
    """The newest checkpoint-N in output_dir, when output_dir lies in TRAINJOBS_CHECKPOINT_DIR (else not ours)."""
    root = os.environ.get(CHECKPOINT_DIR_ENV)
    output_dir = getattr(trainer.args, "output_dir", None)
    if not root or not output_dir:
        return None
    root, output_dir = os.path.realpath(root), os.path.realpath(output_dir)
    if not (output_dir == root or output_dir.startswith(root + os.sep)) or not os.path.isdir(output_dir):
        return None
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir)
    if found and sink.rank0:
        say(f"resuming from {found} (the newest checkpoint in output_dir; resume_from_checkpoint=False starts over)")
    return found


def make_callback(base: type, sink: Sink) -> type:
    class TrainjobsCapture(base):  # type: ignore[misc, valid-type]
        """trainjobs' zero-code capture (TRAINJOBS_CAPTURE=0 leaves it out)."""

        def __init__(self) -> None:
            self.stop = StopOnSignal()
            self.stopped = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sink.guard(SOURCE, self._begin, state)
            sink.guard("preemption", self.stop.install)

        def _begin(self, state: Any) -> None:
            sink.total_steps(state.max_steps)
            sink.resumed(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sink.guard(SOURCE, sink.beat, state.global_step)
            if self.stop.handling and sink.guard("preemption", self.stop.due, state.global_step):
                self.stopped = control.should_save = control.should_training_stop = True
                sink.interrupted()
                if sink.rank0:
                    why = "preempted" if self.stop.preempt else "SIGTERM"
                    say(f"{why}: saving a checkpoint at step {state.global_step} and stopping")

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.stopped and self.stop.preempt:  # saved: now the job may go back to the queue
                sink.guard("preemption", sink.preempted, state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs:
                sink.guard(SOURCE, sink.scalars, state.global_step, logs)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sink.guard("preemption", self.stop.close)
            if not self.stopped:
                sink.guard(SOURCE, self._end, state)

        def _end(self, state: Any) -> None:
            final: dict[str, Any] = {}
            for entry in state.log_history[-10:]:
                final.update(entry)
            final["global_step"] = state.global_step
            sink.reached(state.global_step)
            sink.summary(final)

    return TrainjobsCapture
