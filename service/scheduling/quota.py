"""The quota check a claim makes: a team's or a user's max_slots, under a lock on their rows.

The plan (policy.py) already keeps a job over its quota waiting; this is its fence. Two workers that each take
one job of the same team in one instant both planned before either claim committed, so each saw the quota
free. The claim takes the user's row and their team's row FOR UPDATE, counts the slots the team's (or the
user's) running jobs hold, and refuses a job that would go over: it stays queued. Owners without a quota pay for
one primary-key read.
"""

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.auth.models import User
from service.jobs.models import Job
from service.scheduling.models import Team
from trainjobs.states import JobStatus


def _slots(spec) -> int:
    return spec.resources.nproc_per_node * spec.resources.nnodes


def over_quota(db: Session, *, job_id: str) -> str | None:
    """Why claiming `job_id` now would put its team or its owner over max_slots (locking their rows for the
    claim's transaction), or None. The caller claims in the same transaction."""
    job = db.get(Job, job_id)
    if job is None or job.status != JobStatus.QUEUED:
        return None
    user = db.scalars(select(User).where(User.name == job.owner).with_for_update()).first()
    if user is None:
        return None
    team = db.scalars(select(Team).where(Team.name == user.team).with_for_update()).first() if user.team else None
    team_quota = team.max_slots if team is not None else None
    if user.max_slots is None and team_quota is None:
        return None
    members = ({user.name} if team_quota is None else
               set(db.scalars(select(User.name).where(User.team == user.team))) | {user.name})
    held: dict[str, int] = {}
    for owner, spec in db.execute(select(Job.owner, Job.spec).where(
            Job.owner.in_(members), Job.status.in_([JobStatus.STARTING, JobStatus.RUNNING]))):
        held[owner] = held.get(owner, 0) + _slots(spec)
    want = _slots(job.spec)
    if team_quota is not None and sum(held.values()) + want > team_quota:
        return f"over team quota {user.team}: {sum(held.values())}/{team_quota} slots in use, needs {want}"
    if user.max_slots is not None and held.get(user.name, 0) + want > user.max_slots:
        return f"over user quota {user.name}: {held.get(user.name, 0)}/{user.max_slots} slots in use, needs {want}"
    return None
