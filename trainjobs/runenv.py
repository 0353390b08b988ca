"""What a run sees: the TRAINJOBS_* names the worker sets for every rank, and the metrics-file record format.

The worker (worker/launch.py) sets these; the built-in runtime (worker/train/) and a user's script
(trainjobs.report) read them; the supervisor (worker/shipping.py) reads back what the ranks wrote. One
place for the names, so the three cannot drift apart. Pure standard library: a rank imports it.
"""

import json
import math
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

JOB_ID_ENV = "TRAINJOBS_JOB_ID"
ATTEMPT_ENV = "TRAINJOBS_ATTEMPT"
DATA_DIR_ENV = "TRAINJOBS_DATA_DIR"
CHECKPOINT_DIR_ENV = "TRAINJOBS_CHECKPOINT_DIR"  # the job's, kept across attempts
ARTIFACTS_DIR_ENV = "TRAINJOBS_ARTIFACTS_DIR"  # the job's output, served by GET /v1/jobs/{id}/artifacts
METRICS_FILE_ENV = "TRAINJOBS_METRICS_FILE"  # where local rank 0 of each node appends its records
INIT_FROM_ENV = "TRAINJOBS_INIT_FROM"  # spec.init_from's weights: a model.pt file or a checkpoint folder
RUN_TAG_ENV = "TRAINJOBS_RUN_TAG"  # every process of an attempt carries it: how cancel finds them all

# A job's own `env` (JobSpec.env) may set any variable but these: the service's names, and those that change how
# the worker's processes start, load code or find devices (the run's environment is the service's to set).
RESERVED_ENV_PREFIXES = ("TRAINJOBS_", "TORCHELASTIC_", "TORCH_ELASTIC_", "LD_", "DYLD_")
RESERVED_ENV = frozenset({
    "PATH", "HOME", "TMPDIR", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONEXECUTABLE", "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONINSPECT", "PYTHONUNBUFFERED", "VIRTUAL_ENV",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    # glibc's own list of variables it ignores in a privileged process (UNSECURE_ENVVARS): they load code or read
    # files by path (GCONV_PATH loads a module at the first iconv, GLIBC_TUNABLES had CVE-2023-4911)
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH",
    "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
})


# What a job's env may set though it is ours: a switch of the job's own process (trainjobs/capture).
JOB_SETTABLE_ENV = frozenset({"TRAINJOBS_CAPTURE"})


def reserved_env(name: str) -> bool:
    """A variable a job's `env` may not set."""
    upper = name.upper()
    return upper not in JOB_SETTABLE_ENV and (upper in RESERVED_ENV or upper.startswith(RESERVED_ENV_PREFIXES))


SPEC_FILE = "spec.json"  # in the run dir: the resolved spec the built-in runtime reads
METRICS_FILE = "metrics.jsonl"  # in the run dir
# The supervisor's "checkpoint and exit" to the ranks (SIGTERM stays the cancel path); also worker → work-horse.
PREEMPT_SIGNAL = signal.SIGUSR1
METRIC_NAME_MAX = 64  # the database's metrics.name is a VARCHAR(64)
STEP_MAX = 2**31  # steps are stored as 32-bit integers


def env_path(name: str) -> Path | None:
    """A folder or file the worker named in the environment; None outside the service."""
    value = os.environ.get(name)
    return Path(value) if value else None


class Reporter:
    """Appends one JSON line per record; only where it is enabled (local rank 0 of each node). Never waits."""

    def __init__(self, path: str | os.PathLike | None = None, *, enabled: bool = True):
        path = path or os.environ.get(METRICS_FILE_ENV)
        self._file = open(Path(path), "a", buffering=1) if (path and enabled) else None  # noqa: SIM115

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self._write({"type": "metrics", "step": step, "time": time.time(), "metrics": finite})

    def total_steps(self, total: int) -> None:
        """How many steps the run has (a user's script tells; the runtime's spec says): for progress and ETA."""
        self._write({"type": "progress", "time": time.time(), "total_steps": total})

    def resumed(self, step: int) -> None:
        self._write({"type": "resumed", "time": time.time(), "step": step})

    def preempted(self, step: int) -> None:
        """The run stopped at `step` on request, its checkpoint saved: no summary follows."""
        self._write({"type": "preempted", "time": time.time(), "step": step})

    def summary(self, summary: dict[str, Any]) -> None:
        self._write({"type": "summary", "time": time.time(), "summary": summary})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def parse_record(line: bytes) -> dict | None:
    """One reporter line, or None for a line that is not one.

    NOTE: a user's script can write anything to the metrics file; a bad line (one the database would
    refuse, too) is skipped rather than retried forever.
    """
    try:
        record = json.loads(line)
        kind = record["type"]
        if kind == "summary":
            return record if isinstance(record["summary"], dict) else None
        if kind == "progress":
            return record if is_step(record["total_steps"]) and record["total_steps"] > 0 else None
        if kind in ("resumed", "preempted"):
            return record if is_step(record["step"]) else None
        datetime.fromtimestamp(record["time"], UTC)
        # A name over METRIC_NAME_MAX is the worker's to refuse (one name, with a note), not the whole record.
        if kind == "metrics" and is_step(record["step"]) and all(
                _is_number(value) for value in record["metrics"].values()):
            return record
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, OSError):
        pass
    return None


def is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < STEP_MAX


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
