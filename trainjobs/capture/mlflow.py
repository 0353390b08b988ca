"""The MLflow client: mlflow.log_metric / log_metrics / log_param / log_params / end_run, and MlflowClient's
log_metric / log_batch (what Lightning's MLFlowLogger calls).

A metric is a point under its key at its `step` (MLflow's default, 0, when none is given); params go into the job's
summary, written at end_run (MLflow ends its run at exit itself) or at exit. The calls themselves go on to MLflow as
before: install() points MLFLOW_TRACKING_URI, when the job did not set it, at a file store in the job's checkpoint
dir, so they succeed with no server. A fluent call reaches the client's: the inner one is muted (one point each).
"""

import functools
import sys
from types import ModuleType
from typing import Any

from trainjobs.capture.sink import Sink

SOURCE = "mlflow"


def wrap(sink: Sink, original: Any, capture: Any) -> Any:
    """`original`, which first hands its arguments to `capture` (unless muted), and mutes what it calls itself."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not sink.is_muted():
            sink.guard(SOURCE, capture, *args, **kwargs)
        with sink.muted():
            return original(*args, **kwargs)

    return wrapper


def patch_fluent(module: ModuleType, sink: Sink) -> None:
    def log_metric(key: Any, value: Any, step: Any = None, *args: Any, **kwargs: Any) -> None:
        sink.scalar(key, value, step or 0)

    def log_metrics(metrics: Any, step: Any = None, *args: Any, **kwargs: Any) -> None:
        sink.scalars(step or 0, metrics)

    def log_param(key: Any, value: Any, *args: Any, **kwargs: Any) -> None:
        sink.param(key, value)

    def log_params(params: Any, *args: Any, **kwargs: Any) -> None:
        for key, value in params.items():
            sink.param(key, value)

    def end_run(*args: Any, **kwargs: Any) -> None:
        if sink.dirty and not sink.stopped:
            sink.summary()

    for name, capture in (("log_metric", log_metric), ("log_metrics", log_metrics), ("log_param", log_param),
                          ("log_params", log_params), ("end_run", end_run)):
        if callable(original := getattr(module, name, None)):
            setattr(module, name, wrap(sink, original, capture))
    mlflow = sys.modules.get("mlflow")  # its __init__ may have bound the originals already
    for name in ("log_metric", "log_metrics", "log_param", "log_params", "end_run"):
        if mlflow is not None and getattr(mlflow, name, None) is not None and hasattr(module, name):
            setattr(mlflow, name, getattr(module, name))


def patch_client(module: ModuleType, sink: Sink) -> None:
    client = module.MlflowClient

    def log_metric(self: Any, run_id: Any, key: Any, value: Any, timestamp: Any = None, step: Any = None,
                   *args: Any, **kwargs: Any) -> None:
        sink.scalar(key, value, step or 0)

    def log_batch(self: Any, run_id: Any, metrics: Any = (), params: Any = (), *args: Any, **kwargs: Any) -> None:
        for metric in metrics or ():
            sink.scalar(metric.key, metric.value, metric.step or 0)
        for param in params or ():
            sink.param(param.key, param.value)

    client.log_metric = wrap(sink, client.log_metric, log_metric)
    client.log_batch = wrap(sink, client.log_batch, log_batch)
