"""A gang's nodes 1.. in the worker protocol (issue 42): which node task is still its worker's to run.

The scheduling pass assigns every node of a gang at once (service/scheduling/assign.py), node 0 with the job's
entry; once node 0 claims the job, the pass puts each other node's task (`run_node(job, attempt, node)`) on the
queue of the worker it assigned the node to (service/jobs/assigner.py hand_nodes). The worker takes it off and
asks `assignment` (assign_calls.py), which judges it here: the node still assigned to this worker, its gang still
forming at the attempt the task names, the node not joined yet. The join itself is `gang_join`'s compare-and-set
(attempt_calls.py).
"""

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.jobs.models import Job
from service.scheduling.assignments import Assignment
from trainjobs.states import JobStatus


def assigned_node(db: Session, *, worker_id: str, job_id: str, node_rank: int,
                  attempt: int) -> tuple[Assignment | None, str | None]:
    """The node's assignment, and why its task is stale (None: it is this worker's to run now)."""
    row = db.scalar(select(Assignment).where(Assignment.job_id == job_id, Assignment.node_rank == node_rank))
    job = db.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if job is None:
        return row, f"job {job_id} is unknown"
    if row is None or row.worker_id != worker_id:
        return row, f"node {node_rank} of job {job_id} is not assigned to {worker_id}"
    if job.status != JobStatus.STARTING or job.attempt != attempt or row.attempt + 1 != attempt:
        return row, f"the gang of job {job_id} is not forming at attempt {attempt} (job {job.status}, " \
                    f"attempt {job.attempt})"
    return row, None
