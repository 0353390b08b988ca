"""Where captured scalars go: trainjobs' reporter, from global rank 0 only, bounded, and never raising into training.

What a framework hands us is untrusted input (a NaN, a 10 kB name, a million distinct tags, a step of -1 or a
string): each kind of bad point is dropped, with one `[trainjobs] capture:` line in the job's log the first time and
a count at the end. The worker bounds what it stores on its own (MetricCaps); these bounds keep the job's own
memory and its metrics file small before that. A hook that raises is turned off, with one line, and the script
goes on (`guard`).
"""

import atexit
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainjobs.reporting import _reporter
from trainjobs.runenv import METRIC_NAME_MAX, STEP_MAX, Reporter

MAX_NAMES = 10_000  # distinct names this job's capture keeps (the worker's own cap, 1,000 by default, is lower)
SUMMARY_NAMES = 100  # the last value of at most this many series goes into the summary
MAX_PARAMS = 100  # MLflow params kept for the summary
PARAM_CHARS = 250  # MLflow's own limit on a param's value
BEAT_S = 1.0  # at most this often a step-only record between two logged ones: progress and ETA stay live
PREFIX = "[trainjobs] capture:"

DROPS = {  # each reads "... are not stored"
    "long": f"points under names longer than {METRIC_NAME_MAX} characters",
    "names": f"points under names past the first {MAX_NAMES:,}",
    "nonfinite": "non-finite values (NaN, inf)",
    "step": f"points at steps outside 0..{STEP_MAX - 1}",
    "value": "values that are not numbers",
}


def say(text: str) -> None:
    """One line in the job's log (stderr: the supervisor ships it with the script's own output)."""
    try:
        print(f"{PREFIX} {text}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001,S110 - a closed stderr must not fail the script either
        pass


def number(value: Any) -> float | None:
    """A scalar as a float: int, float, bool, numpy scalars, one-element tensors; None for anything else."""
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str | bytes) or value is None:
        return None
    try:
        return float(value)  # numpy scalars, 0-d arrays and tensors (.item() is what TensorBoard itself takes)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None


class Sink:
    """Every source's points in one place: one set of bounds, one summary, one tally."""

    def __init__(self, *, rank0: bool | None = None):
        self.rank0 = os.environ.get("RANK", "0") == "0" if rank0 is None else rank0
        self.names: dict[str, int] = {}  # name -> points taken (the step of a point given without one)
        self.at: dict[str, int] = {}  # name -> the step of its last point: a second one there is left out
        self.last: dict[str, float] = {}  # the last value of the first SUMMARY_NAMES series
        self.params: dict[str, str] = {}
        self.step = -1  # the highest step written
        self.total: int | None = None
        self.dropped: dict[str, int] = dict.fromkeys(DROPS, 0)
        self.off: set[str] = set()  # sources turned off after an error
        self.extra: dict[str, Any] = {}  # a framework's own final figures, for the summary
        self.dirty = False  # taken in since the last summary
        self.stopped = False  # stopped by a signal: no summary at exit (the job is not done)
        self._beat = 0.0
        self._out: Reporter | None = None
        self._local = threading.local()
        self._started = time.monotonic()

    # -- input --

    def scalars(self, step: Any, metrics: Mapping[Any, Any]) -> None:
        """Points at `step` (an int; anything else is dropped), as many as the bounds let through."""
        if not self.rank0:
            return
        if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step < STEP_MAX):
            self.drop("step", f"step {str(step)[:40]!r}", len(metrics))
            return
        points = {}
        for key, raw in metrics.items():
            name = key if isinstance(key, str) else str(key)
            if (value := self.accept(name, raw, step)) is not None:
                points[name] = value
        if points:
            self.write(step, points)

    def scalar(self, name: Any, raw: Any, step: Any) -> None:
        """One point; without a step, the count of points under its name so far (as a plot's x would go)."""
        if not self.rank0:
            return
        name = name if isinstance(name, str) else str(name)
        if step is None:
            step = self.names.get(name, 0)
        elif not isinstance(step, int):
            step = int(step) if isinstance(step, float) and step.is_integer() else step
        self.scalars(step, {name: raw})

    def accept(self, name: str, raw: Any, step: int) -> float | None:
        if len(name) > METRIC_NAME_MAX:
            self.drop("long", f"{name[:40]!r}... ({len(name):,} characters)")
            return None
        value = number(raw)
        if value is None:
            self.drop("value", f"{name} = {str(raw)[:40]!r}")
            return None
        if name not in self.names:
            if len(self.names) >= MAX_NAMES:
                self.drop("names", f"{name[:40]!r}")
                return None
            self.names[name] = 0
        self.names[name] += 1
        if self.at.get(name) == step:  # e.g. Trainer's `epoch`, in its train and its eval logs of one step
            return None
        self.at[name] = step
        if not math.isfinite(value):
            self.drop("nonfinite", f"{name} = {value} at step {step}")
            return None
        if name in self.last or len(self.last) < SUMMARY_NAMES:
            self.last[name] = value
        return value

    def param(self, name: Any, value: Any) -> None:
        name = str(name)[:METRIC_NAME_MAX]
        if name in self.params or len(self.params) < MAX_PARAMS:
            self.params[name], self.dirty = str(value)[:PARAM_CHARS], True

    def drop(self, kind: str, example: str, count: int = 1) -> None:
        if not self.dropped[kind]:
            say(f"{DROPS[kind]} are not stored (the first: {example}); the rest are counted at the end")
        self.dropped[kind] += count

    # -- output --

    def out(self) -> Reporter:
        """trainjobs.report's own reporter (one file, one writer), found once: a rank's environment does not change."""
        if self._out is None:
            self._out = _reporter()
        return self._out

    def write(self, step: int, points: dict[str, float]) -> None:
        self.out().log(step, points)
        self.step, self.dirty = max(self.step, step), True

    def beat(self, step: int) -> None:
        """The step reached, at most every BEAT_S, with no metrics: the job's progress between two logged steps."""
        if not self.rank0 or step <= self.step:
            return
        now = time.monotonic()
        if now - self._beat >= BEAT_S:
            self._beat = now
            self.out().log(step, {})
            self.step = step

    def reached(self, step: Any) -> None:
        """The run's last step, written whatever the time since the last beat: the progress a user sees at the end
        is the summary's global_step (a framework logs at the batch index, one less, and the last beat may be
        held back by BEAT_S)."""
        if self.rank0 and isinstance(step, int) and self.step < step < STEP_MAX:
            self.out().log(step, {})
            self.step = step

    def total_steps(self, total: Any) -> None:
        if self.rank0 and isinstance(total, int) and 0 < total < STEP_MAX and total != self.total:
            self.total = total
            self.out().total_steps(total)

    def resumed(self, step: Any) -> None:
        if self.rank0 and isinstance(step, int) and 0 < step < STEP_MAX:
            self.out().resumed(step)

    def preempted(self, step: Any) -> None:
        """Stopped at `step` on PREEMPT_SIGNAL, its checkpoint saved: the job goes back to the queue, no summary."""
        if self.rank0 and isinstance(step, int) and 0 <= step < STEP_MAX:
            self.out().preempted(step)
            self.interrupted()

    def interrupted(self) -> None:
        """Stopped by a signal before its end (a cancel, a hand-back, a preemption): no summary at exit, the job
        is not done."""
        self.dirty, self.stopped = False, True

    def summary(self, values: Mapping[str, Any] | None = None) -> None:
        """The job's summary: the last value of each series, the framework's own final figures, MLflow params."""
        if not self.rank0:
            return
        for key, value in (values or {}).items():
            key = str(key)[:METRIC_NAME_MAX]
            if key in self.extra or len(self.extra) < SUMMARY_NAMES:
                self.extra[key] = plain(value)
        found: dict[str, Any] = {**self.last, **self.extra}
        if self.step >= 0:
            found.setdefault("step", self.step)
        if self.params:
            found["params"] = dict(self.params)
        found["run_s"] = round(time.monotonic() - self._started, 3)  # since the rank started the script
        self.out().summary(found)
        self.dirty = False

    def at_exit(self) -> None:
        """Last: a summary if no framework wrote one (a SummaryWriter loop), and what the bounds dropped."""
        if self.rank0 and self.dirty and not self.stopped:
            self.summary()
        if any(self.dropped.values()):
            say("not stored, in all: " + "; ".join(f"{DROPS[k]}: {n:,}" for k, n in self.dropped.items() if n))

    # -- safety --

    def muted(self) -> "Muted":
        """While a framework logs through TensorBoard or MLflow itself: their hooks stay quiet (no duplicates)."""
        return Muted(self._local)

    def is_muted(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def guard(self, source: str, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a capture hook; should it raise, turn `source` off with one line and return None."""
        if source in self.off:
            return None
        try:
            return hook(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - capture must never fail the script
            self.off.add(source)
            say(f"{source} capture turned off after an error inside it ({type(error).__name__}: "
                f"{str(error)[:200]}); the script goes on")
            return None

    def register_exit(self) -> None:
        atexit.register(self.guard, "summary", self.at_exit)


class Muted:
    """Sink.muted's context: a counter per thread (cheaper than a generator-based context manager)."""

    __slots__ = ("local",)

    def __init__(self, local: threading.local):
        self.local = local

    def __enter__(self) -> None:
        self.local.depth = getattr(self.local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self.local.depth -= 1


def plain(value: Any) -> Any:
    """A summary value JSON can hold: numbers (non-finite as None), strings, bools, None; anything else as text."""
    if value is None or isinstance(value, bool | str):
        return value[:PARAM_CHARS] if isinstance(value, str) else value
    if isinstance(value, int) and abs(value) < 2**63:
        return value
    found = number(value) if not isinstance(value, int) else float(value)
    if found is None:
        return str(value)[:PARAM_CHARS]
    return found if math.isfinite(found) else None
