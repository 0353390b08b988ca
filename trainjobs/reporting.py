"""Metrics and progress from your own training script (entrypoint mode), in the built-in runtime's format.

    from trainjobs import report, summary

    report(step=step, loss=loss.item(), total_steps=max_steps)   # every few steps
    summary(final_loss=loss.item())                               # once, at the end

Local rank 0 of each node writes (the LOCAL_RANK that torchrun sets), to the file the service names in
TRAINJOBS_METRICS_FILE; the service ships the lines to GET /v1/jobs/{id}/metrics (a multi-node job keeps a
series per node: node 0's are the job's, and its progress). summary() is global rank 0's only (RANK).
Call report() on every rank: it writes on local rank 0 only. A script that calls it on RANK 0 alone reports
from whichever node c10d gave that rank: that node's series (?node_rank=k) then holds it, and the job's
progress follows it all the same.
Without that variable (a bare torchrun, a laptop) every call does nothing, so the same script runs anywhere.
Never imports torch: a tensor metric is fine (float() is taken), but importing this module costs nothing.
"""

import os
import warnings
from pathlib import Path
from typing import Any

from trainjobs.runenv import (
    ARTIFACTS_DIR_ENV,
    CHECKPOINT_DIR_ENV,
    METRIC_NAME_MAX,
    METRICS_FILE_ENV,
    STEP_MAX,
    Reporter,
    env_path,
    is_step,
)

__all__ = ["artifacts_dir", "checkpoint_dir", "report", "summary"]

_open: tuple[str | None, Reporter] | None = None  # (the path it writes to, the reporter)
_total: int | None = None
_warned: set[str] = set()  # names over METRIC_NAME_MAX already warned about


def _reporter() -> Reporter:
    """The reporter for the current environment; reopened if TRAINJOBS_METRICS_FILE changes."""
    global _open, _total
    path = os.environ.get(METRICS_FILE_ENV) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    if _open is None or _open[0] != path:
        if _open is not None:
            _open[1].close()
        _open, _total = (path, Reporter(path, enabled=path is not None)), None
    return _open[1]


def report(step: int, *, total_steps: int | None = None, **metrics: float) -> None:
    """Record scalar metrics at `step` (and, once known, how many steps the run has: for progress and ETA)."""
    global _total
    if not is_step(step):
        raise ValueError(f"step must be an int from 0 to {STEP_MAX - 1}, got {step!r}")
    for name in metrics:
        if len(name) > METRIC_NAME_MAX and name not in _warned:  # the service refuses it, and says so in the job
            _warned.add(name)
            warnings.warn(f"trainjobs.report: metric names are at most {METRIC_NAME_MAX} characters; {name!r} is "
                          "not stored", stacklevel=2)
    reporter = _reporter()
    if total_steps is not None and total_steps != _total:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or not 0 < total_steps < STEP_MAX:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        reporter.total_steps(total_steps)
        _total = total_steps
    reporter.log(step, metrics)


def summary(**values: Any) -> None:
    """Record the run's final values: the job's `summary` (JSON-serialisable values; global rank 0's only)."""
    if os.environ.get("RANK", "0") == "0":
        _reporter().summary(values)


def checkpoint_dir() -> Path | None:
    """The job's checkpoint folder, kept across attempts (None outside the service)."""
    return env_path(CHECKPOINT_DIR_ENV)


def artifacts_dir() -> Path | None:
    """The job's output folder, served by GET /v1/jobs/{id}/artifacts (None outside the service)."""
    return env_path(ARTIFACTS_DIR_ENV)
