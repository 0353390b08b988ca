"""The reporter: JSON lines the supervisor tails and ships to the database. Never waits on it."""

import json
import math
import os
import time
from pathlib import Path
from typing import Any

METRICS_FILE_ENV = "TRAINJOBS_METRICS_FILE"


class Reporter:
    """Appends one JSON line per report; only the rank it is enabled on writes (local rank 0 of each node)."""

    def __init__(self, path: str | os.PathLike | None = None, *, enabled: bool = True):
        path = path or os.environ.get(METRICS_FILE_ENV)
        self._file = open(Path(path), "a", buffering=1) if (path and enabled) else None  # noqa: SIM115

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self._write({"type": "metrics", "step": step, "time": time.time(), "metrics": finite})

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
