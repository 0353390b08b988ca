import csv
import io
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.auth.deps import PrincipalDep, visible_job
from service.auth.tokens import Principal
from service.deps import INT32_MAX
from service.errors import JobNotFound, responses
from service.metrics import service
from service.metrics.charts import ChartKey
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
async def read_metrics(
    job_id: str,
    request: Request,
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
    state = request.app.state
    if format == "csv":
        rank = node_rank if "node_rank" in request.query_params else None
        await run_in_threadpool(check_visible, state.sessionmaker, job_id, principal)
        return StreamingResponse(csv_rows(state.sessionmaker, job_id=job_id, name=name, node_rank=rank),
                                 media_type="text/csv; charset=utf-8",
                                 headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})
    key: ChartKey = (job_id, node_rank, name, after_step, max_points)
    if state.loop_reads is None:  # SQLite: the owner check and the chart's version in a session, in the threadpool
        body = await run_in_threadpool(chart_in_session, state, key, principal)
    else:
        head = await state.loop_reads.series_head(job_id, node_rank) if len(job_id) <= 64 else None
        if head is None or not (principal.is_admin or head[0] == principal.user):
            raise JobNotFound(job_id)
        _, cursor, newest = head
        body = state.charts.get(key, newest)
        if body is None:
            body = await run_in_threadpool(render_chart, state, key, cursor=cursor, newest=newest)
    # NOTE: the bytes, not the model: FastAPI would dump the model, validate the dump against response_model
    # and serialize it again (three passes over every point).
    return Response(content=body, media_type="application/json")


def check_visible(factory: sessionmaker[Session], job_id: str, principal: Principal) -> None:
    with factory() as db:
        visible_job(db, job_id=job_id, principal=principal)  # someone else's job: 404


def chart_in_session(state, key: ChartKey, principal: Principal) -> bytes:
    job_id, node_rank = key[0], key[1]
    with state.sessionmaker() as db:
        visible_job(db, job_id=job_id, principal=principal)  # someone else's job: 404
        cursor = service.stream_cursor(db, job_id=job_id)
        newest = cursor if node_rank == 0 else service.newest_point(db, job_id=job_id, node_rank=node_rank)
    body = state.charts.get(key, newest)
    return body if body is not None else render_chart(state, key, cursor=cursor, newest=newest)


def render_chart(state, key: ChartKey, *, cursor: int, newest: int) -> bytes:
    """The chart, read after its cursor (a point between the two is sent twice, never lost) and kept for newest."""
    job_id, node_rank, name, after_step, max_points = key
    with state.sessionmaker() as db:
        if max_points is not None:
            series = service.read_thinned(db, job_id=job_id, node_rank=node_rank, max_points=max_points, name=name,
                                          after_step=after_step)
        else:
            series = service.read_series(db, job_id=job_id, node_rank=node_rank, name=name, after_step=after_step)
    body = MetricsPublic(node_rank=node_rank, cursor=cursor, series=series).model_dump_json().encode()
    state.charts.put(key, newest, body)
    return body
