"""What the API returns for sweeps: the sweep with its counts and best trial, and its table of trials."""

from collections import Counter
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from service.lists import Listing
from service.sweeps.models import Sweep
from service.sweeps.service import TrialRow, best_of, config_of


class TrialPublic(BaseModel):
    index: int
    job_id: str
    status: str
    reason: str | None  # "stopped_early": its sweep's early stopping cancelled it (finished, not failed)
    params: dict[str, Any]
    steps: int
    last: float | None  # the sweep's metric: its last value, and its best (min or max, by the goal)
    best: float | None
    started_at: datetime | None
    finished_at: datetime | None
    run_s: float | None  # started to finished (or now)

    @classmethod
    def of(cls, row: TrialRow) -> "TrialPublic":
        return cls(**vars(row))


class TrialCounts(BaseModel):
    total: int  # trials the sweep will make
    made: int
    queued: int = 0
    starting: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0  # by the user or the sweep's cancel (stopped_early is counted apart)
    stopped_early: int = 0


class SweepPublic(BaseModel):
    id: str
    name: str
    owner: str
    status: str  # running | succeeded (every trial ended) | cancelled | failed (a trial could not be made)
    error: str | None
    method: str
    parameters: dict[str, Any]
    max_trials: int
    parallel: int
    metric: dict[str, str]
    early_stopping: dict[str, Any] | None
    seed: int | None
    spec: dict[str, Any]
    trials: TrialCounts
    best: TrialPublic | None  # the trial with the best value of the metric so far
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(cls, row: Sweep, trials: list[TrialRow]) -> "SweepPublic":
        config = config_of(row)
        counts = Counter("stopped_early" if t.stopped_early else t.status for t in trials)
        best = best_of(trials, config.metric.goal)
        data = config.model_dump(mode="json")
        return cls(id=row.id, name=row.name, owner=row.owner, status=row.status, error=row.error,
                   method=config.method, parameters=data["parameters"], max_trials=config.total_trials,
                   parallel=config.parallel, metric=data["metric"], early_stopping=data["early_stopping"],
                   seed=config.seed, spec=data["spec"],
                   trials=TrialCounts(total=config.total_trials, made=len(trials), **counts),
                   best=TrialPublic.of(best) if best else None, created_at=row.created_at,
                   finished_at=row.finished_at)


class SweepsPublic(BaseModel):
    items: list[SweepPublic]
    next_cursor: str | None


class TrialsPublic(Listing):
    items: list[TrialPublic]
    count: int
