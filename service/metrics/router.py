from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from service.deps import SessionDep
from service.jobs import service as jobs
from service.metrics import service


class Series(BaseModel):
    name: str
    steps: list[int]
    values: list[float]


class MetricsPublic(BaseModel):
    series: list[Series]


router = APIRouter(prefix="/v1/jobs", tags=["metrics"])


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def read_metrics(
    job_id: str,
    db: SessionDep,
    name: Annotated[str | None, Query(max_length=64)] = None,
    after_step: Annotated[int | None, Query(ge=-1)] = None,
) -> MetricsPublic:
    jobs.get(db, job_id=job_id)
    return MetricsPublic(series=service.read_series(db, job_id=job_id, name=name, after_step=after_step))
