"""Sweeps on the database: create, read (owner-isolated), list, and each sweep's trials with their metric."""

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.errors import NotFound
from service.jobs.models import Job
from service.lists import newest_first, page_of
from service.metrics.models import MetricBlock
from service.sweeps.models import Sweep
from trainjobs.paths import is_job_id, new_job_id
from trainjobs.states import STOPPED_EARLY, SweepStatus
from trainjobs.sweep import Metric, SweepSpec


class SweepNotFound(NotFound):
    def __init__(self, sweep_id: str):
        super().__init__(f"sweep {sweep_id!r} not found", field="sweep_id")


def create(db: Session, *, sweep: SweepSpec, principal) -> Sweep:
    """Insert a running sweep (the caller commits); a random search without a seed gets one now, so every trial
    it makes, before or after a restart, is drawn from the same stream."""
    if sweep.seed is None:
        sweep = sweep.model_copy(update={"seed": secrets.randbelow(2**31)})
    row = Sweep(id=new_job_id(), owner=principal.user, role=principal.role,
                can_run_entrypoints=principal.can_run_entrypoints, name=sweep.name,
                config=sweep.model_dump(mode="json"), status=SweepStatus.RUNNING, created_at=utcnow())
    db.add(row)
    db.flush()
    return row


def config_of(row: Sweep) -> SweepSpec:
    return SweepSpec.model_validate(row.config)


def visible(db: Session, *, sweep_id: str, principal) -> Sweep:
    """The sweep if the caller may see it (its owner, or an admin); anyone else's is a 404, as a job's is."""
    row = db.get(Sweep, sweep_id) if is_job_id(sweep_id) else None
    if row is None or not (principal.is_admin or row.owner == principal.user):
        raise SweepNotFound(sweep_id)
    return row


def list_page(db: Session, *, owner: str | None, status: SweepStatus | None, limit: int,
              cursor: str | None) -> tuple[list[Sweep], str | None]:
    """A page of sweeps, newest first; the cursor is the last one's id."""
    query = newest_first(select(Sweep), Sweep.id, cursor=cursor, limit=limit)
    if owner is not None:
        query = query.where(Sweep.owner == owner)
    if status is not None:
        query = query.where(Sweep.status == status)
    return page_of(db.scalars(query).all(), limit=limit)


@dataclass
class TrialRow:
    index: int
    job_id: str
    status: str
    reason: str | None
    params: dict
    steps: int
    last: float | None
    best: float | None
    started_at: datetime | None
    finished_at: datetime | None
    run_s: float | None  # started to finished (or to now): × its processes, the device time it used

    @property
    def stopped_early(self) -> bool:
        return self.status == "cancelled" and self.reason == STOPPED_EARLY


def trials(db: Session, *, metrics: dict[str, Metric]) -> dict[str, list[TrialRow]]:
    """Each sweep's trials in trial order, with its metric's last and best value read from the block summaries
    (service/metrics/blocks.py: one row per 256 steps, not every point). metrics: sweep id -> its metric."""
    sweep_ids = list(metrics)
    if not sweep_ids:
        return {}
    jobs = db.execute(select(Job.id, Job.sweep_id, Job.sweep_trial, Job.status, Job.reason, Job.sweep_params,
                             Job.progress, Job.started_at, Job.finished_at)
                      .where(Job.sweep_id.in_(list(sweep_ids))).order_by(Job.sweep_id, Job.sweep_trial)).all()
    by_job = {j.id: j.sweep_id for j in jobs}
    blocks: dict[str, list] = {}
    if jobs:
        for b in db.execute(select(MetricBlock.job_id, MetricBlock.name, MetricBlock.block, MetricBlock.last_value,
                                   MetricBlock.min_value, MetricBlock.max_value)
                            .where(MetricBlock.job_id.in_(list(by_job)), MetricBlock.node_rank == 0,
                                   MetricBlock.name.in_({m.name for m in metrics.values()}))
                            .order_by(MetricBlock.job_id, MetricBlock.block)):
            if b.name == metrics[by_job[b.job_id]].name:
                blocks.setdefault(b.job_id, []).append(b)
    now = utcnow()
    found: dict[str, list[TrialRow]] = {s: [] for s in sweep_ids}
    for j in jobs:
        mine = blocks.get(j.id, [])
        goal_min = metrics[j.sweep_id].goal == "minimize"
        best = (min(b.min_value for b in mine) if goal_min else max(b.max_value for b in mine)) if mine else None
        run_s = ((j.finished_at or now) - j.started_at).total_seconds() if j.started_at else None
        found[j.sweep_id].append(TrialRow(
            index=j.sweep_trial, job_id=j.id, status=j.status, reason=j.reason if j.status == "cancelled" else None,
            params=j.sweep_params or {}, steps=(j.progress or {}).get("step", 0),
            last=mine[-1].last_value if mine else None, best=best, started_at=j.started_at,
            finished_at=j.finished_at, run_s=run_s))
    return found


def best_of(rows: Sequence[TrialRow], goal: str) -> TrialRow | None:
    """The trial with the best value of the metric so far (the first such, on a tie)."""
    scored = [r for r in rows if r.best is not None]
    if not scored:
        return None
    return min(scored, key=lambda r: (r.best if goal == "minimize" else -r.best, r.index))
