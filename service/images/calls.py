"""The worker protocol's image calls (issue 44): the login a node pulls its job's image with, and the digest it
resolved. Both behind `protocol.own_attempt`: a worker learns only the login of a job it runs, only for that
job's image's registry, and only while the attempt exists.
"""

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service.errors import InvalidRequest, InvalidTransition, NotFound
from service.images import service
from service.jobs.models import Job
from service.runners import protocol
from service.runners.attempt_calls import AttemptRef  # also registers `phase`, which a pull reports through
from service.runners.protocol import Context
from trainjobs.states import LIVE


class ImageLogin(BaseModel):
    """The login for the job's image's registry; username and password null: its owner has none (a public image,
    or one the pull will be refused)."""

    registry: str
    owner: str = Field(description="the job's owner, for the job's messages")
    username: str | None = None
    password: str | None = None
    whose: str | None = Field(None, description='"user alice" or "team ml": whose login it is')


class ImagePulled(AttemptRef):
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    pulled_s: float | None = Field(None, ge=0, le=86400 * 7, description="null: found in the worker's cache")


def _image_job(db: Session, ctx: Context, body: AttemptRef) -> tuple[Job, str]:
    """The job of the caller's own attempt, and the image its spec names."""
    if protocol.own_attempt(db, ctx.caller, job_id=body.job_id, attempt=body.attempt,
                            node_rank=body.node_rank) is None:
        raise NotFound(f"job {body.job_id} has no attempt {body.attempt} (node {body.node_rank})", field="attempt")
    job = db.get(Job, body.job_id)
    image = job.spec.image if job is not None and job.spec is not None else None
    if not image:
        raise InvalidRequest(f"job {body.job_id} names no image", field="job_id")
    return job, image


@protocol.call("image-login", body=AttemptRef, answer=ImageLogin)
def image_login(db: Session, ctx: Context, body: AttemptRef) -> ImageLogin:
    """The registry login a node pulls its job's image with: the owner's own for that registry, else the owner's
    team's; none otherwise. Read only; the worker keeps it only for the pull."""
    job, image = _image_job(db, ctx, body)
    if job.attempt != body.attempt or job.status not in LIVE:
        raise InvalidTransition(f"attempt {body.attempt} of job {body.job_id} no longer holds it (job {job.status}, "
                                f"attempt {job.attempt}): no login is lent for it", field="attempt")
    registry = service.registry_of(image)
    login = service.login_for(db, ctx.settings, owner=job.owner, registry=registry)
    if login is None:
        return ImageLogin(registry=registry, owner=job.owner)
    return ImageLogin(registry=registry, owner=job.owner, username=login.username, password=login.password,
                      whose=login.whose)


@protocol.call("image-pulled", body=ImagePulled)
def image_pulled(db: Session, ctx: Context, body: ImagePulled) -> None:
    """The manifest digest a node runs its job's image at: a job event ("image sha256:… resolved from X"), once
    per attempt and node (a replay adds none)."""
    _, image = _image_job(db, ctx, body)
    service.record_pulled(db, job_id=body.job_id, attempt=body.attempt, node_rank=body.node_rank, image=image,
                          digest=body.digest, pulled_s=body.pulled_s)
    db.commit()
