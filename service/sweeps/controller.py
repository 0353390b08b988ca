"""The sweep controller: one pass over every running sweep, from the API's sweeper loop (one at a time, under its
Redis lock). Each pass keeps `parallel` trials queued or running, stops losing trials early, and ends the sweep
once every trial has ended.

Restart-safe because it holds no state of its own: what a pass decides comes from the database (the sweep, its
trials, their metric points), trial n's parameters from (seed, n) alone, and trial n is made with the
Idempotency-Key `sweep:<id>:<n>` under a unique (sweep_id, sweep_trial): a pass that dies half-way, or two that
race, make each trial once.
"""

import logging

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.auth.limits import TooManyRequests
from service.auth.tokens import Principal
from service.errors import TrainjobsError
from service.jobs import admission, lifecycle, queue
from service.jobs.models import Job
from service.jobs.service import Trial
from service.metrics.models import Metric
from service.settings import Settings
from service.sweeps import service
from service.sweeps.models import Sweep
from trainjobs import stopping
from trainjobs.states import TERMINAL, JobStatus, SweepStatus
from trainjobs.sweep import SweepSpec, trial_parameters, trial_spec

log = logging.getLogger(__name__)


def advance_all(db: Session, redis: Redis, settings: Settings) -> None:
    """One pass over the running sweeps, and the live trials of any that ended (a cancel half done)."""
    for sweep_id in list(db.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.RUNNING).order_by(Sweep.id))):
        try:
            advance(db, redis, settings, db.get(Sweep, sweep_id))
        except Exception:  # noqa: BLE001 - one sweep's trouble must not hold up the others
            db.rollback()
            log.exception("sweep %s: pass failed", sweep_id)
    ended = select(Job.sweep_id).join(Sweep, Sweep.id == Job.sweep_id).where(
        Sweep.status != SweepStatus.RUNNING, Job.status.not_in(TERMINAL), Job.cancel_requested_at.is_(None))
    for sweep_id in set(db.scalars(ended)):
        cancel_trials(db, redis, settings, sweep_id=sweep_id)


def advance(db: Session, redis: Redis, settings: Settings, row: Sweep) -> None:
    config = service.config_of(row)
    trials = db.execute(select(Job.id, Job.sweep_trial, Job.status, Job.cancel_requested_at, Job.progress)
                        .where(Job.sweep_id == row.id)).all()
    if config.stopping is not None:
        stop_losers(db, config, sweep_id=row.id, trials=trials)
    made = {t.sweep_trial for t in trials}
    live = sum(t.status not in TERMINAL for t in trials)
    principal = Principal(user=row.owner, role=row.role, token_id=None,
                          can_run_entrypoints=row.can_run_entrypoints)
    for index in range(config.total_trials):
        if live >= config.parallel:
            break
        if index in made:
            continue
        params = trial_parameters(config, index)
        try:
            spec = trial_spec(config, sweep_id=row.id, index=index, params=params)
            admission.admit(spec, db=db, redis=redis, settings=settings, principal=principal,
                            idempotency_key=f"sweep:{row.id}:{index}", trial=Trial(row.id, index, params))
        except TooManyRequests:  # the owner's quota is full: the next pass tries again, as a user would
            db.rollback()
            return
        except TrainjobsError as exc:  # this trial can never be made (refused spec, init_from gone, ...)
            db.rollback()
            if lifecycle.move_sweep(db, sweep_id=row.id, to=SweepStatus.FAILED,
                                    error=f"trial {index} ({params}) was refused: {exc.message}"):
                db.commit()
            return
        made.add(index)
        live += 1
    if live == 0 and len(made) >= config.total_trials:
        if lifecycle.move_sweep(db, sweep_id=row.id, to=SweepStatus.SUCCEEDED):
            db.commit()
            log.info("sweep %s: every trial has ended", row.id)
    db.rollback()  # a pass holds no transaction between sweeps


def work_done(progress: dict | None) -> bool:
    """The job's stored progress says it reached its last step (counted from 0 or 1)."""
    step, total = (progress or {}).get("step") or 0, (progress or {}).get("total_steps")
    return bool(total) and step >= total - 1


def stop_losers(db: Session, config: SweepSpec, *, sweep_id: str, trials) -> None:
    """Read the metric series of the sweep's trials and stop, by the normal cancel path, those the rule drops."""
    # A trial that reported its last step has no work left to stop: it is never stopped early (its supervisor
    # lets it end too, should a stop race its last step: worker/supervisor.py _take_held).
    running = {t.id for t in trials if t.status == JobStatus.RUNNING and t.cancel_requested_at is None
               and not work_done(t.progress)}
    if not running:
        return
    rule = config.stopping
    max_steps = None if config.spec.entrypoint else config.spec.train.max_steps
    query = (select(Metric.job_id, Metric.step, Metric.value, Metric.time)
             .where(Metric.job_id.in_([t.id for t in trials]), Metric.node_rank == 0,
                    Metric.name == config.metric.name)
             .order_by(Metric.job_id, Metric.step, Metric.attempt))
    series: dict[str, dict[int, stopping.Point]] = {}
    for p in db.execute(query):
        series.setdefault(p.job_id, {})[p.step] = stopping.Point(p.step, p.value, p.time.timestamp())  # last attempt
    stops = stopping.decide({j: list(points.values()) for j, points in series.items()}, running=running,
                            rule=rule, max_steps=max_steps, goal=config.metric.goal)
    db.rollback()
    for job_id, why in stops.items():
        if lifecycle.stop_early(db, job_id=job_id, detail=why):
            log.info("sweep %s: trial job %s stopped early: %s", sweep_id, job_id, why)


def cancel_trials(db: Session, redis: Redis, settings: Settings, *, sweep_id: str) -> None:
    """Cancel every trial of the sweep not yet ended: queued ones at once, started ones by their supervisors."""
    live = db.execute(select(Job.id, Job.priority).where(Job.sweep_id == sweep_id, Job.status.not_in(TERMINAL),
                                                         Job.cancel_requested_at.is_(None))).all()
    db.rollback()
    for job_id, priority in live:
        try:
            _, was_queued = lifecycle.request_cancel(db, job_id=job_id)
        except TrainjobsError:  # it ended meanwhile
            db.rollback()
            continue
        if was_queued:
            try:
                queue.drop(redis, prefix=settings.queue_prefix, job_id=job_id, priority=priority)
            except RedisError:
                log.warning("could not drop cancelled trial %s from Redis; the worker will skip it", job_id)
