"""GET /v1/jobs/{id}/events: a job's status, progress, log size and new metric points as Server-Sent Events.

Each poll opens a short sync session in a thread (no session is held across the stream) and reads at most
BATCH_ROWS metric rows: a long backlog goes out batch after batch (the next read waits until the last batch
was sent, so a slow reader holds one), never loaded whole. Every event's id is the metrics cursor (the last
metrics.id sent), so a client that reconnects with Last-Event-ID gets the status and progress again and only
the metric points it has not seen. `?metrics=new` starts at the series' end, `?metrics=none` sends no points
(a follower of the log and the status).
"""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Header, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from service.auth.deps import JobIdDep
from service.deps import INT64_MAX
from service.errors import InvalidRequest, responses
from service.jobs import service as jobs
from service.logs.models import LogChunk
from service.metrics.models import Metric
from service.metrics.service import stream_cursor
from trainjobs.states import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["events"])
BATCH_ROWS = 5000  # metric rows per `metrics` event
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)]
MetricsMode = Literal["all", "new", "none"]


@dataclass
class Snapshot:
    status: str
    progress: dict[str, Any]
    log_end: int  # bytes of output stored: a `logs` event tells a follower when to read GET .../logs
    cursor: int  # after `series`
    series: list[dict]  # the next batch of points: at most BATCH_ROWS rows
    more: bool  # the batch was full: more rows may wait after the cursor
    pending_reason: str | None = None  # while queued: why no worker has taken it; while starting: what it does


def read_metrics_after(db: Session, *, job_id: str, cursor: int, limit: int) -> tuple[int, list[dict], int]:
    """Up to `limit` metric rows with id > cursor as series; (new cursor, series, rows read)."""
    rows = db.execute(
        select(Metric.id, Metric.name, Metric.step, Metric.value)
        .where(Metric.job_id == job_id, Metric.node_rank == 0, Metric.id > cursor)
        .order_by(Metric.id)
        .limit(limit)
    ).all()
    series: dict[str, dict] = {}
    for _id, name, step, value in rows:
        entry = series.setdefault(name, {"name": name, "steps": [], "values": []})
        entry["steps"].append(step)
        entry["values"].append(value)
    return (rows[-1][0] if rows else cursor), list(series.values()), len(rows)


def read_log_end(db: Session, *, job_id: str) -> int:
    """The byte offset where node 0's log ends (a single-node job's whole log): its chunks are appended in
    order, so the last one by start (a backward walk of ix_log_chunks_job_start, however long the log)."""
    end = db.scalar(select(LogChunk.start + LogChunk.length).where(LogChunk.job_id == job_id, LogChunk.node_rank == 0)
                    .order_by(LogChunk.start.desc()).limit(1))
    return end or 0


def poll(factory: sessionmaker[Session], job_id: str, cursor: int, with_metrics: bool) -> Snapshot:
    """The job, then its log size and the next batch of metric rows after the cursor: a job read as terminal
    has shipped all of its output and points, so once a batch comes back short the stream has sent them all."""
    with factory() as db:
        job = jobs.get(db, job_id=job_id)
        snapshot = Snapshot(status=job.status, progress=dict(job.progress or {}),
                            pending_reason=job.pending_reason if job.status in (JobStatus.QUEUED, JobStatus.STARTING)
                            else None,
                            log_end=read_log_end(db, job_id=job_id), cursor=cursor, series=[], more=False)
        if with_metrics:
            # NOTE: one attempt at a time ships a job's series (node 0's: the other nodes of a gang ship theirs
            # concurrently, so they are not streamed), in id order, so a cursor on metrics.id skips none.
            snapshot.cursor, snapshot.series, count = read_metrics_after(db, job_id=job_id, cursor=cursor,
                                                                         limit=BATCH_ROWS)
            snapshot.more = count == BATCH_ROWS
        return snapshot


def read_end_cursor(factory: sessionmaker[Session], job_id: str) -> int:
    with factory() as db:
        return stream_cursor(db, job_id=job_id)


def parse_cursor(last_event_id: str | None) -> int:
    if last_event_id is None or last_event_id == "":
        return 0
    # ASCII digits only ("²" is a digit to str.isdigit), and no more than metrics.id holds.
    if not (last_event_id.isascii() and last_event_id.isdigit()) or int(last_event_id) > INT64_MAX:
        raise InvalidRequest("Last-Event-ID is not an id this stream sent", field="Last-Event-ID")
    return int(last_event_id)


def event(kind: str, cursor: int, data: Any) -> ServerSentEvent:
    return ServerSentEvent(event=kind, id=str(cursor), data=json.dumps(data))


async def job_events(request: Request, job_id: str, cursor: int | None, mode: MetricsMode
                     ) -> AsyncIterator[ServerSentEvent]:
    factory, poll_s = request.app.state.sessionmaker, request.app.state.settings.poll_s
    if cursor is None:  # no Last-Event-ID: the whole series, or only what comes after its present end
        cursor = await run_in_threadpool(read_end_cursor, factory, job_id) if mode == "new" else 0
    status = progress = None
    log_end = 0  # an empty log sends no `logs` event
    while True:
        snap = await run_in_threadpool(poll, factory, job_id, cursor, mode != "none")
        terminal = JobStatus(snap.status).is_terminal()
        if (snap.status, snap.pending_reason) != status and not terminal:  # queued: why it waits, as it changes
            yield event("status", cursor, {"status": snap.status, **({"pending_reason": snap.pending_reason}
                                                                       if snap.pending_reason else {})})
        if snap.progress != progress:
            yield event("progress", cursor, snap.progress)
        if snap.log_end != log_end:
            yield event("logs", cursor, {"next_offset": snap.log_end})
        if snap.series:
            cursor = snap.cursor
            yield event("metrics", cursor, {"series": snap.series})
        status, progress, log_end = (snap.status, snap.pending_reason), snap.progress, snap.log_end
        if snap.more:  # a backlog: the next batch at once
            continue
        if terminal:  # the final status is the last event; then the stream ends
            yield event("status", cursor, {"status": snap.status})
            return
        await anyio.sleep(poll_s)


@router.get("/{job_id}/events", responses=responses(404))
def stream_events(job_id: JobIdDep, request: Request, last_event_id: LastEventId = None,
                  metrics: Annotated[MetricsMode, Query(description="`all` (default): every point, in batches; "
                                                        "`new`: from the series' end; `none`: no `metrics` events"
                                                        )] = "all") -> EventSourceResponse:
    """Events `status` (on connect and on change), `progress` (on change), `logs` ({"next_offset"}: the log's
    size, on change), `metrics` (points, at most 5000 rows an event); ends after a terminal status. Reconnect
    with Last-Event-ID to resume the metric points where the stream left off."""
    # JobIdDep answered an unknown or foreign job's 404 already.
    cursor = parse_cursor(last_event_id) if last_event_id else None
    return EventSourceResponse(job_events(request, job_id, cursor, metrics))
