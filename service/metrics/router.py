from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from service.auth.deps import JobIdDep
from service.deps import SessionDep
from service.errors import responses
from service.metrics import service


class Series(BaseModel):
    name: str
    steps: list[int]
    values: list[float]


class MetricsPublic(BaseModel):
    series: list[Series]


router = APIRouter(prefix="/v1/jobs", tags=["metrics"])


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=responses(404))
def read_metrics(
    job_id: JobIdDep,
    db: SessionDep,
    name: Annotated[str | None, Query(max_length=64)] = None,
    after_step: Annotated[int | None, Query(ge=-1)] = None,
    max_points: Annotated[int | None, Query(ge=1, le=100_000)] = None,
) -> MetricsPublic:
    """Every series of the job; with max_points, each thinned to at most that many points (min/max per bucket)."""
    if max_points is not None:
        return MetricsPublic(series=service.read_thinned(db, job_id=job_id, max_points=max_points, name=name,
                                                         after_step=after_step))
    return MetricsPublic(series=service.read_series(db, job_id=job_id, name=name, after_step=after_step))
