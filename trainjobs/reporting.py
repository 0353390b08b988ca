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

Throughput and MFU: `report(step, flops_per_step=F)` with F the model FLOPs of one optimizer step over all ranks
(forward and backward; 6 x parameters x tokens of the global batch for a transformer) adds `step_time_s`, the
wall time per step since the previous report() (measured here, in the rank) and, on a CUDA device that
trainjobs/peaks.py knows (from the torch the script loaded), `mfu` against its bf16 peak times WORLD_SIZE; the
summary then carries the run's mean step time and MFU (the job's `performance`). An unknown device, or a CPU,
gets no mfu rather than a wrong one.
"""

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from trainjobs.peaks import PEAK_FLOPS_ENV, peak_flops
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


class _Speed:
    """Wall time between report() calls that give flops_per_step: step time, MFU, and their run totals."""

    def __init__(self):
        self.last: tuple[int, float] | None = None  # (step, perf_counter) of the previous such call
        self.steps, self.seconds, self.flops = 0, 0.0, 0.0
        self.flops_per_step: float | None = None
        self.device: tuple[str, float | None] | None = None  # (device name, its bf16 peak), once CUDA is in use

    def measure(self, step: int, flops_per_step: float) -> dict[str, float]:
        now, out = time.perf_counter(), {}
        if self.last is not None and step > self.last[0] and now > self.last[1]:
            steps, seconds = step - self.last[0], now - self.last[1]
            self.steps, self.seconds, self.flops = self.steps + steps, self.seconds + seconds, \
                self.flops + steps * flops_per_step
            out["step_time_s"] = seconds / steps
            if (peak := self.peak()) is not None:
                out["mfu"] = steps * flops_per_step / seconds / (peak * _world_size())
        self.last, self.flops_per_step = (step, now), flops_per_step
        return out

    def peak(self) -> float | None:
        if self.device is None:
            torch = sys.modules.get("torch")  # the script's own torch, if it loaded one: never imported here
            if torch is None or not torch.cuda.is_initialized():
                return peak_flops("") if os.environ.get(PEAK_FLOPS_ENV) else None  # the worker's declared peak
            name = torch.cuda.get_device_name(torch.cuda.current_device())
            self.device = (name, peak_flops(name))
        return self.device[1]

    def totals(self) -> dict[str, Any]:
        """For the summary: the run's mean step time and MFU over every measured step."""
        if not self.steps:
            return {}
        out: dict[str, Any] = {"step_time_s": self.seconds / self.steps, "flops_per_step": self.flops_per_step}
        if self.device is not None:
            out["device_name"] = self.device[0]
        if (peak := self.peak()) is not None:
            out["mfu"] = self.flops / self.seconds / (peak * _world_size())
            out["peak_flops"] = peak
        return out


def _world_size() -> int:
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


_speed = _Speed()


def _reporter() -> Reporter:
    """The reporter for the current environment; reopened if TRAINJOBS_METRICS_FILE changes."""
    global _open, _total
    path = os.environ.get(METRICS_FILE_ENV) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    if _open is None or _open[0] != path:
        if _open is not None:
            _open[1].close()
        _open, _total = (path, Reporter(path, enabled=path is not None)), None
    return _open[1]


def report(step: int, *, total_steps: int | None = None, flops_per_step: float | None = None,
           **metrics: float) -> None:
    """Record scalar metrics at `step` (and, once known, how many steps the run has: for progress and ETA).

    flops_per_step: the model FLOPs of one step over all ranks; adds step_time_s and, on a known GPU, mfu.
    """
    global _total
    if not is_step(step):
        raise ValueError(f"step must be an int from 0 to {STEP_MAX - 1}, got {step!r}")
    if flops_per_step is not None:
        number = isinstance(flops_per_step, int | float) and not isinstance(flops_per_step, bool)
        if not number or not 0 < flops_per_step < math.inf:
            raise ValueError(f"flops_per_step must be a positive number, got {flops_per_step!r}")
        metrics = {**_speed.measure(step, float(flops_per_step)), **metrics}  # the script's own names win
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
        _reporter().summary({**_speed.totals(), **values})


def checkpoint_dir() -> Path | None:
    """The job's checkpoint folder, kept across attempts (None outside the service)."""
    return env_path(CHECKPOINT_DIR_ENV)


def artifacts_dir() -> Path | None:
    """The job's output folder, served by GET /v1/jobs/{id}/artifacts (None outside the service)."""
    return env_path(ARTIFACTS_DIR_ENV)
