from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from service.api.deps import INT32_MAX, SessionDep
from service.auth.deps import PrincipalDep, visible_job
from service.errors import responses
from service.metrics import service


class Series(BaseModel):
    name: str
    steps: list[int]
    values: list[float]


class MetricsPublic(BaseModel):
    node_rank: int  # whose series these are: node 0's are the job's (the only node of a one-node job)
    # Send it as Last-Event-ID to GET /v1/jobs/{id}/events to be streamed only the points written after this
    # answer (the stream may repeat a few of its last points: the same step and value again).
    cursor: int
    series: list[Series]


router = APIRouter(prefix="/v1/jobs", tags=["metrics"])


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=responses(404))
def read_metrics(
    job_id: str,
    db: SessionDep,
    principal: PrincipalDep,
    name: Annotated[str | None, Query(max_length=64)] = None,
    after_step: Annotated[int | None, Query(ge=-1, le=INT32_MAX)] = None,
    max_points: Annotated[int | None, Query(ge=1, le=100_000)] = None,
    node_rank: Annotated[int, Query(ge=0, le=1023)] = 0,  # nnodes is at most 1024
) -> MetricsPublic:
    """Every series of the job; with max_points, each thinned to at most that many points (min/max per bucket).

    A multi-node job keeps a series per node, reported by each node's local rank 0: node 0's (the default)
    are the job's; `node_rank=k` gives node k's, with its own step time and memory. A node that reported
    nothing (or does not exist) has no series.
    """
    with db:  # the owner check and the reads in one session, closed in this thread (see jobs.router.read_job)
        visible_job(db, job_id=job_id, principal=principal)  # someone else's job: 404
        cursor = service.stream_cursor(db, job_id=job_id)  # before the series: a point between them is sent twice
        if max_points is not None:
            series = service.read_thinned(db, job_id=job_id, node_rank=node_rank, max_points=max_points, name=name,
                                          after_step=after_step)
        else:
            series = service.read_series(db, job_id=job_id, node_rank=node_rank, name=name, after_step=after_step)
        return MetricsPublic(node_rank=node_rank, cursor=cursor, series=series)
