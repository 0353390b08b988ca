"""What the API returns for jobs."""

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from service.jobs.models import Job


class Progress(BaseModel):
    step: int = 0
    total_steps: int
    eta_s: float | None = None


class JobPublic(BaseModel):
    id: str
    name: str
    owner: str
    status: str
    priority: str
    spec: dict[str, Any]
    attempt: int
    max_retries: int
    progress: Progress
    summary: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None

    @classmethod
    def of(cls, job: Job) -> "JobPublic":
        progress = {"total_steps": job.spec["train"]["max_steps"], **(job.progress or {})}
        return cls(
            id=job.id, name=job.name, owner=job.owner, status=job.status, priority=job.priority,
            spec=job.spec, attempt=job.attempt, max_retries=job.max_retries,
            progress=Progress(**progress), summary=job.summary, error=job.error,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            cancel_requested_at=job.cancel_requested_at,
        )


class JobsPublic(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None
