"""What the control plane writes on the jobs from the scheduler's plan: why each queued job waits
(`pending_reason`), the preemptions the plan asks of running jobs (`apply`, from the scheduler's pass,
service/jobs/assigner.py, with the plan it assigns by), and priority aging so `low` never starves (`age`, the
sweeper's). Each write is a compare-and-set on the job's status (and, for aging, its priority and queue time); the
plan itself is service/scheduling's, which writes no job row."""

import logging
from collections.abc import MutableMapping
from datetime import timedelta

from redis import Redis
from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import queue
from service.jobs import service as jobs
from service.jobs.models import Job
from service.scheduling import policy
from service.scheduling import service as scheduling
from service.settings import Settings
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
SCAN = 500  # queued jobs looked at per pass, oldest first
UP = {"low": "normal", "normal": "high"}


def explain(db: Session, settings: Settings, cache: MutableMapping[str, scheduling.Req] | None = None) -> policy.Plan:
    """Plan the pool (service/scheduling/policy.py) on its own and write `apply`'s part of it: each queued job's
    pending_reason (None once it is about to start) and the preemptions (the scheduler's pass applies its own
    plan instead). The caller commits; `cache` is the caller's, kept between passes (scheduling.snapshot)."""
    plan = policy.plan(scheduling.snapshot(db, settings, cache=cache))
    apply(db, plan)
    return plan


def request_preemption(db: Session, p: policy.Preemption) -> bool:
    """Ask a running job to hand its workers back (its supervisor reads it on its next renewal). The caller
    commits; False when it no longer runs or was asked already."""
    done = db.execute(update(Job).where(Job.id == p.victim, Job.status == JobStatus.RUNNING,
                                        Job.preempt_requested_at.is_(None))
                      .values(preempt_requested_at=utcnow(), preempt_detail=p.detail)).rowcount == 1
    if done:
        jobs.record_event(db, job_id=p.victim, kind="preempt_requested", detail=p.detail)
        log.info("job %s: %s", p.victim, p.detail)
    return done


def apply(db: Session, plan: policy.Plan) -> tuple[int, int]:
    """What a plan writes on the jobs: each queued job's pending_reason, and the preemptions. The caller commits."""
    reasons = {p.job_id: p.reason for p in plan.order}
    changed = 0
    if reasons:
        # The reasons stored now, of the queued jobs the snapshot planned (the same query: no IN of 2,000 ids); one
        # queued since is missing here and keeps its reason until the next pass.
        current = dict(db.execute(select(Job.id, Job.pending_reason).where(Job.status == JobStatus.QUEUED)
                                  .order_by(Job.created_at, Job.id).limit(scheduling.MAX_WAITING)).all())
        changes = []
        for job_id, reason in reasons.items():
            if reason is not None:
                reason = reason[:1000]
            if current.get(job_id, reason) != reason:
                changes.append({"b_job": job_id, "b_reason": reason})
        if changes:  # one statement, executed for each (a burst of submissions: hundreds of new reasons a pass)
            jobs = Job.__table__
            changed = db.execute(update(jobs).where(jobs.c.id == bindparam("b_job"), jobs.c.status == JobStatus.QUEUED)
                                 .values(pending_reason=bindparam("b_reason")), changes).rowcount
    preempted = sum(request_preemption(db, p) for p in plan.preemptions)
    return changed, preempted


def age(db: Session, redis: Redis, *, prefix: str, aging_s: float) -> list[str]:
    """A job queued longer than aging_s moves up one priority (low → normal → high), by compare-and-set.

    Its wait restarts at the new level, so `low` reaches `high` after twice aging_s. Its queue entry moves
    with it (after the commit: the row is the truth, the entry only a hint the reconciler can rebuild).
    """
    cutoff = utcnow() - timedelta(seconds=aging_s)
    moved = []
    for job_id, priority, spec in db.execute(select(Job.id, Job.priority, Job.spec).where(
            Job.status == JobStatus.QUEUED, Job.priority.in_(list(UP)), Job.queued_at <= cutoff).limit(SCAN)):
        done = db.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED,
                                            Job.priority == priority, Job.queued_at <= cutoff)
                          .values(priority=UP[priority], queued_at=utcnow())).rowcount
        if done:
            jobs.record_event(db, job_id=job_id, kind="aged",
                              detail=f"waited over {aging_s:g}s: priority {priority} → {UP[priority]}")
            moved.append((job_id, priority, spec.timeout_s))
    db.commit()
    for job_id, priority, timeout_s in moved:
        old = queue.get_queue(redis, prefix, priority)
        if old.remove(job_id):  # else a worker has it, or the reconciler will enqueue it at its new level
            queue.enqueue(redis, prefix=prefix, job_id=job_id, priority=UP[priority], timeout_s=timeout_s)
    if moved:
        log.info("aged %d queued job(s) up one priority: %s", len(moved), [m[0] for m in moved])
    return [m[0] for m in moved]
