"""Zero-code capture: an unmodified Hugging Face Trainer, Lightning, TensorBoard or MLflow script reports to trainjobs.

worker/user_main.py calls install() on every rank of an entrypoint job before the user's code runs. What it does:

- **A lazy import hook.** A finder first on sys.meta_path that answers for nothing but a few module names (a set
  lookup per first import of a module, ~0.1 us; nothing at all once training runs). When one of them is imported,
  it lets the real loader run the module and then patches it, so a script that never imports a framework never
  loads it, and trainjobs never needs it installed (the service does not). Modules already imported when
  install() runs are patched at once.
- **Per framework** (each in its own module here):
  - `transformers.trainer` (hf.py): Trainer.__init__ adds a TrainerCallback, whatever `report_to` says ("none"
    included): on_log's numbers at state.global_step, under the names Trainer logs them (`loss`, `grad_norm`,
    `learning_rate`, `eval_loss`, ...); total steps = state.max_steps; a summary at on_train_end.
  - `lightning.pytorch` / `pytorch_lightning` (lightning.py): the logger connector's log_metrics, i.e. exactly
    the names and steps its loggers get (even with logger=False), and its loops' start, step and end (wrapped: no
    Callback, whose every hook Lightning would call every step) for the total (estimated_stepping_batches), the
    live step and the summary.
  - `torch.utils.tensorboard` / `tensorboardX` SummaryWriter (tensorboard.py): add_scalar / add_scalars
    (`main/tag`), at their global_step.
  - MLflow (mlflow.py): log_metric / log_metrics / log_param(s) and MlflowClient.log_metric / log_batch; the
    params go into the summary. MLFLOW_TRACKING_URI, when the job does not set it, is a file store in the job's
    checkpoint dir, kept across attempts (MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 refuses one without), so the
    script's own calls succeed with no server.
  While a Trainer logs through its own TensorBoard or MLflow integration, those hooks stay quiet (Sink.muted):
  one series per name, not two.
- **Bounds and safety** (sink.py): global rank 0 alone reports (no duplicates under DDP); NaN/inf, names past 64
  characters, more than 10,000 names, values that are no number, bad steps are dropped with one line each in the
  job's log; an exception in a hook turns that source off with one line, and the script goes on. No event file is
  read: the values come from the calls.
- **Resume and preemption** (hf.py, lightning.py, stop.py): a Trainer whose output_dir (Lightning: ModelCheckpoint's
  dirpath) lies in TRAINJOBS_CHECKPOINT_DIR resumes from the newest checkpoint there when train()/fit() is not
  told otherwise; on SIGTERM or PREEMPT_SIGNAL HF's Trainer saves a checkpoint at a step the ranks agree on and
  stops, Lightning stops there too and saves last.ckpt in its checkpoint dir; on PREEMPT_SIGNAL rank 0 then reports
  `preempted` (the job goes back to the queue, no retry spent).

TRAINJOBS_CAPTURE=0 in a job's env turns all of it off (a script that reports through trainjobs.report itself
loses nothing: its own calls are untouched).
"""

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from trainjobs.capture.sink import Sink, say
from trainjobs.runenv import CHECKPOINT_DIR_ENV

CAPTURE_ENV = "TRAINJOBS_CAPTURE"
OFF = ("0", "false", "no", "off")

# module -> (its source's name, our module, the function that patches it)
WATCHED = {
    "transformers.trainer": ("transformers", "trainjobs.capture.hf", "patch"),
    "lightning.pytorch.trainer.trainer": ("lightning", "trainjobs.capture.lightning", "patch"),
    "pytorch_lightning.trainer.trainer": ("lightning", "trainjobs.capture.lightning", "patch"),
    "torch.utils.tensorboard.writer": ("tensorboard", "trainjobs.capture.tensorboard", "patch"),
    "tensorboardX.writer": ("tensorboard", "trainjobs.capture.tensorboard", "patch"),
    "mlflow.tracking.fluent": ("mlflow", "trainjobs.capture.mlflow", "patch_fluent"),
    "mlflow.tracking.client": ("mlflow", "trainjobs.capture.mlflow", "patch_client"),
}


def enabled(env: dict[str, str] | os._Environ = os.environ) -> bool:
    return env.get(CAPTURE_ENV, "1").strip().lower() not in OFF


def install() -> Sink | None:
    """Install the hooks for this process (once); None where TRAINJOBS_CAPTURE turns them off."""
    if not enabled():
        return None
    for finder in sys.meta_path:
        if isinstance(finder, CaptureFinder):
            return finder.sink
    sink = Sink()
    sink.register_exit()
    if os.environ.get(CHECKPOINT_DIR_ENV) and "MLFLOW_TRACKING_URI" not in os.environ:
        # NOTE: not the artifacts dir: MLflow's file store refuses a run under any folder named `artifacts`.
        os.environ["MLFLOW_TRACKING_URI"] = "file:" + os.path.join(os.environ[CHECKPOINT_DIR_ENV], "mlruns")
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    finder = CaptureFinder(sink)
    sys.meta_path.insert(0, finder)
    for name in list(finder.waiting):
        if (module := sys.modules.get(name)) is not None:
            finder.patch(name, module)
    return sink


class CaptureFinder:
    """Finds no module itself: for a watched one it asks the other finders, then patches the module once run."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.waiting = dict(WATCHED)

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.patch(fullname, module)

        try:
            loader.exec_module = exec_module  # this module's own loader object only
        except (AttributeError, TypeError):
            pass
        return spec

    def patch(self, name: str, module: ModuleType) -> None:
        if (entry := self.waiting.pop(name, None)) is None:
            return
        source, ours, function = entry
        patcher: Callable[[ModuleType, Sink], None] | None = self.sink.guard(
            source, lambda: getattr(importlib.import_module(ours), function))
        if patcher is not None:
            self.sink.guard(source, patcher, module, self.sink)


__all__ = ["CAPTURE_ENV", "CaptureFinder", "Sink", "enabled", "install", "say"]
