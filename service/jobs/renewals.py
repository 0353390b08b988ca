"""A worker's attempts held together (issue 42, docs/architecture.md "The worker protocol"): the jobs of one tick
locked in one statement, every lease it renews in one UPDATE, and the fence of every batch it ships read in one
SELECT, where `lifecycle.hold` and `lifecycle.still_held` take two statements per attempt.

The lock order is the lifecycle's (`lifecycle.lock_job`: a job's row before its attempts'), taken over several jobs
in the order of their ids, so two ticks, a tick and the sweeper, or a tick and a user's cancel never wait on each
other in a cycle.
"""

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from service.jobs.lifecycle import Held, lease_until
from service.jobs.models import Attempt, Job
from trainjobs.states import LIVE, STOPPED_EARLY, AttemptStatus

Ref = tuple[str, int, int]  # (job id, attempt number, node rank)


def lock_jobs(db: Session, job_ids: set[str]) -> dict[str, object]:
    """The jobs' rows (what a renewal tells its attempt), locked for this transaction in the order of their ids."""
    if not job_ids:
        return {}
    rows = db.execute(select(Job.id, Job.attempt, Job.status, Job.cancel_requested_at, Job.progress,
                             Job.stacks_requested_at, Job.preempt_requested_at, Job.preempt_detail, Job.reason)
                      .where(Job.id.in_(sorted(job_ids))).order_by(Job.id).with_for_update()).all()
    return {row.id: row for row in rows}


def hold_many(db: Session, refs: list[Ref], *, jobs: dict[str, object], lease_s: float) -> dict[Ref, Held | None]:
    """Renew every node's lease of `refs` lease_s ahead of the database's clock, in one UPDATE, and say what each
    job asks of it; None for a node that lost its job (closed, a newer attempt, the job ended). `jobs`: the rows
    lock_jobs read, in this transaction."""
    if not refs:
        return {}
    renewed = {(r.job_id, r.number, r.node_rank) for r in db.execute(
        update(Attempt).where(tuple_(Attempt.job_id, Attempt.number, Attempt.node_rank).in_(refs),
                              Attempt.status == AttemptStatus.ACTIVE)
        .values(lease_expires_at=lease_until(db, lease_s))
        .returning(Attempt.job_id, Attempt.number, Attempt.node_rank))}
    return {ref: _held(jobs.get(ref[0]), ref, renewed, full=True) for ref in refs}


def held_many(db: Session, refs: list[Ref], *, jobs: dict[str, object]) -> dict[Ref, Held | None]:
    """Whether each node of `refs` still holds its job, renewing nothing: the fence of the batches it ships."""
    if not refs:
        return {}
    active = {(r.job_id, r.number, r.node_rank) for r in db.execute(
        select(Attempt.job_id, Attempt.number, Attempt.node_rank)
        .where(tuple_(Attempt.job_id, Attempt.number, Attempt.node_rank).in_(refs),
               Attempt.status == AttemptStatus.ACTIVE))}
    return {ref: _held(jobs.get(ref[0]), ref, active, full=False) for ref in refs}


def _held(job, ref: Ref, active: set[Ref], *, full: bool) -> Held | None:
    if job is None or job.attempt != ref[1] or job.status not in LIVE or ref not in active:
        return None
    step = (job.progress or {}).get("step") or 0
    if not full:  # as lifecycle.still_held tells it
        return Held(cancel_requested=job.cancel_requested_at is not None, progress_step=step)
    return Held(cancel_requested=job.cancel_requested_at is not None, progress_step=step,
                stacks_requested_at=job.stacks_requested_at,
                preempt_detail=(job.preempt_detail or "preempted") if job.preempt_requested_at is not None else None,
                stopped_early=job.reason == STOPPED_EARLY)
