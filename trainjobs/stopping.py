"""Early stopping of a sweep's trials, pure: which running trials to stop, given every trial's metric series.

Decisions depend only on the points (step, value, time reported), not on when they are asked, so a controller
that restarts, or asks twice, decides the same.
"""

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from trainjobs.sweep import Asha, Median

MAX_RUNGS = 40


@dataclass(frozen=True)
class Point:
    step: int
    value: float
    time: float  # when it was reported (seconds on any one clock): who reached a rung first


Series = Mapping[str, Sequence[Point]]  # trial -> its points, in step order


def rungs(rule: Asha, max_steps: int | None) -> list[int]:
    """min_steps × reduction_factor^k below max_steps (a trial at max_steps is done: nothing to save)."""
    found, step = [], rule.min_steps
    while (max_steps is None or step < max_steps) and len(found) < MAX_RUNGS:
        found.append(step)
        step *= rule.reduction_factor
    return found


def better(a: float, b: float, goal: str) -> bool:
    return a < b if goal == "minimize" else a > b


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def incumbent(series: Series, goal: str) -> str | None:
    """The trial holding the best value reported so far: never stopped."""
    best = None
    for trial, points in series.items():
        for p in points:
            if best is None or better(p.value, best[1], goal):
                best = (trial, p.value)
    return best[0] if best else None


def at_rung(points: Sequence[Point], rung: int) -> Point | None:
    """The trial's first point at or past the rung: its value there and when it got there."""
    return next((p for p in points if p.step >= rung), None)


def asha_stops(series: Series, *, running: Collection[str], rule: Asha, max_steps: int | None,
               goal: str) -> dict[str, str]:
    """Running trials to stop, each with why. At each rung it reached, a trial is compared with the trials that
    reached that rung before it (itself included): it goes on only if its value is at least the 1/rf quantile
    from the best end (with one trial there, that is itself: the first to arrive always goes on)."""
    keep = incumbent(series, goal)
    q = 1 / rule.reduction_factor if goal == "minimize" else 1 - 1 / rule.reduction_factor
    stops = {}
    for trial in running:
        if trial == keep:
            continue
        for rung in rungs(rule, max_steps):
            mine = at_rung(series.get(trial, ()), rung)
            if mine is None:
                break
            peers = [p.value for p in (at_rung(s, rung) for s in series.values()) if p and p.time <= mine.time]
            cutoff = quantile(peers, q)
            if better(cutoff, mine.value, goal):
                stops[trial] = (f"{mine.value:.6g} at step {mine.step} is outside the "
                                f"top 1/{rule.reduction_factor} of {len(peers)} trials at rung {rung} "
                                f"(cutoff {cutoff:.6g})")
                break
    return stops


def median_stops(series: Series, *, running: Collection[str], rule: Median, goal: str) -> dict[str, str]:
    """Running trials whose best value so far is worse than the median of the other trials' running averages
    at the same step, past min_steps and once at least min_trials others reached that step."""
    keep = incumbent(series, goal)
    stops = {}
    for trial in running:
        points = series.get(trial, ())
        if trial == keep or not points or points[-1].step < rule.min_steps:
            continue
        step = points[-1].step
        mine = min(p.value for p in points) if goal == "minimize" else max(p.value for p in points)
        averages = [statistics.fmean(p.value for p in s if p.step <= step)
                    for other, s in series.items() if other != trial and s and s[-1].step >= step]
        if len(averages) >= rule.min_trials and better(statistics.median(averages), mine, goal):
            stops[trial] = (f"best {mine:.6g} by step {step} is worse than the median running average "
                            f"{statistics.median(averages):.6g} of {len(averages)} other trials")
    return stops


def decide(series: Series, *, running: Collection[str], rule: Asha | Median | None, max_steps: int | None,
           goal: str) -> dict[str, str]:
    if isinstance(rule, Asha):
        return asha_stops(series, running=running, rule=rule, max_steps=max_steps, goal=goal)
    if isinstance(rule, Median):
        return median_stops(series, running=running, rule=rule, goal=goal)
    return {}
