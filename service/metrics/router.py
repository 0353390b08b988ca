import csv
import io
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.api.deps import INT32_MAX, SessionDep
from service.auth.deps import PrincipalDep, visible_job
from service.errors import responses
from service.metrics import service
from service.metrics.models import Metric


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


CSV_BATCH = 5000
CSV_COLUMNS = ("step", "name", "value", "node_rank", "attempt", "time")


def csv_rows(factory: sessionmaker[Session], *, job_id: str, name: str | None, node_rank: int | None) -> Iterator[str]:
    """Every stored point as CSV, in batches of CSV_BATCH by id (a session per batch: a slow reader holds none)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    after = 0
    while True:
        query = (select(Metric.id, Metric.step, Metric.name, Metric.value, Metric.node_rank, Metric.attempt,
                        Metric.time).where(Metric.job_id == job_id, Metric.id > after)
                 .order_by(Metric.id).limit(CSV_BATCH))
        if name is not None:
            query = query.where(Metric.name == name)
        if node_rank is not None:
            query = query.where(Metric.node_rank == node_rank)
        with factory() as db:
            rows = db.execute(query).all()
        for row in rows:
            writer.writerow((row.step, row.name, repr(row.value), row.node_rank, row.attempt,
                             row.time.isoformat().replace("+00:00", "Z")))
        yield out.getvalue()
        out.seek(0)
        out.truncate()
        if len(rows) < CSV_BATCH:
            return
        after = rows[-1].id


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=responses(404) | {
    200: {"content": {"text/csv": {}}, "description": "with format=csv: every stored point, one per line"}})
def read_metrics(
    job_id: str,
    request: Request,
    db: SessionDep,
    principal: PrincipalDep,
    name: Annotated[str | None, Query(max_length=64)] = None,
    after_step: Annotated[int | None, Query(ge=-1, le=INT32_MAX)] = None,
    max_points: Annotated[int | None, Query(ge=1, le=100_000)] = None,
    node_rank: Annotated[int, Query(ge=0, le=1023)] = 0,  # nnodes is at most 1024
    format: Annotated[Literal["json", "csv"], Query(description="csv: every stored point (step, name, value, "
                                                      "node_rank, attempt, time) of every node, or of node_rank "
                                                      "when given; name filters; no thinning")] = "json",
):
    """Every series of the job; with max_points, each thinned to at most that many points (min/max per bucket).

    A multi-node job keeps a series per node, reported by each node's local rank 0: node 0's (the default)
    are the job's; `node_rank=k` gives node k's, with its own step time and memory. A node that reported
    nothing (or does not exist) has no series.
    """
    with db:  # the owner check and the reads in one session, closed in this thread (see jobs.router.read_job)
        visible_job(db, job_id=job_id, principal=principal)  # someone else's job: 404
        if format == "csv":
            rank = node_rank if "node_rank" in request.query_params else None
            return StreamingResponse(csv_rows(request.app.state.sessionmaker, job_id=job_id, name=name,
                                              node_rank=rank), media_type="text/csv; charset=utf-8",
                                     headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})
        cursor = service.stream_cursor(db, job_id=job_id)  # before the series: a point between them is sent twice
        if max_points is not None:
            series = service.read_thinned(db, job_id=job_id, node_rank=node_rank, max_points=max_points, name=name,
                                          after_step=after_step)
        else:
            series = service.read_series(db, job_id=job_id, node_rank=node_rank, name=name, after_step=after_step)
        body = MetricsPublic(node_rank=node_rank, cursor=cursor, series=series).model_dump_json()
    # NOTE: the bytes, not the model: FastAPI would dump the model, validate the dump against response_model
    # and serialize it again (three passes over every point; a 500-point chart's largest cost in Python).
    return Response(content=body, media_type="application/json")
