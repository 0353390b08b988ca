"""A job's events for webhooks: which job events they name, and the body's job, as GET /v1/jobs/{id} shows it.

Called by record_event, so every event of a job reaches the outbox in the transaction that records it,
whichever path (the API, a worker, the sweeper) made the change.
"""

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.models import Job
from service.jobs.schemas import JobPublic
from service.webhooks import outbox

# A job_events kind → the webhook event it is. A hand-back (lifecycle.hand_back: queued again, no retry spent)
# is job.preempted, which its transition names itself: a retry's "queued" is no event.
EVENT_OF_KIND = {"running": "job.started", "succeeded": "job.succeeded", "failed": "job.failed",
                 "cancelled": "job.cancelled", "hung": "job.hung"}


def notify(db: Session, *, job_id: str, event: str) -> int:
    """Put the job's `event` in its webhooks' outbox, with the job as it is now in this transaction."""

    def data() -> dict:
        job = db.get(Job, job_id, populate_existing=True)  # NOTE: the CAS's UPDATE bypassed the session
        return {"job": JobPublic.of(job).model_dump(mode="json")}

    owner = select(Job.owner).where(Job.id == job_id).scalar_subquery()
    return outbox.emit(db, event=event, subject=f"job/{job_id}", owner=owner, data=data)
