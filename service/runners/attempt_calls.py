"""The worker protocol's calls on an attempt's life (issue 42): what a worker says of the attempts it runs.

Each is a compare-and-set of service/jobs/lifecycle.py (or a records write) behind `protocol.own_attempt`, and
answers a replay as it answered the first time.
"""

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service.jobs import records
from service.runners import protocol
from service.runners.protocol import Context

JOB_ID = Field(max_length=32)


class AttemptRef(BaseModel):
    job_id: str = JOB_ID
    attempt: int = Field(ge=1, le=2**31 - 1)
    node_rank: int = Field(0, ge=0, le=4096)


class PhaseBody(AttemptRef):
    phase: str = Field(max_length=500)


@protocol.call("phase", body=PhaseBody)
def phase(db: Session, ctx: Context, body: PhaseBody) -> None:
    """What a starting attempt is doing before its ranks run (installing requirements, launching): the job's
    pending_reason while it starts. Written only while the attempt holds the job and it starts."""
    protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank)
    records.record_phase(db, job_id=body.job_id, attempt=body.attempt, phase=body.phase)
    db.commit()
