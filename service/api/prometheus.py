"""GET /metrics: the service in Prometheus text format, on a registry of its own per app.

Jobs by status, queued jobs and queue depths per priority, live workers and their free slots, metric points
and the two job latencies are read at scrape time (a custom collector): the database and Redis are the truth,
and the API process sees no worker transition and no metric a worker ships. The jobs per status are counts
kept as jobs change (service/jobs/counts.py), so a scrape costs the same at a million jobs as at ten.
The latencies are histograms over the last LATENCY_WINDOW jobs, so their counts can fall; read them as
gauges (histogram_quantile over the raw buckets), not with rate(). Request latency is observed in-process.
"""

import logging
import time
from bisect import bisect_right
from collections.abc import Iterable
from datetime import datetime

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import Float, cast, func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.auth.deps import current_principal
from service.db import utcnow
from service.jobs import counts as job_counts
from service.jobs import queue
from service.jobs.models import Job
from service.metrics.models import Metric as MetricRow
from service.webhooks import outbox
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Worker
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
router = APIRouter(tags=["observability"])
LATENCY_WINDOW = 1000  # jobs, newest first
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600)
DURATION_BUCKETS = (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600)


def add_samples(family: HistogramMetricFamily, labels: list[str], samples: Iterable[float | None],
                buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """One labelled histogram from raw samples: cumulative buckets, +Inf and the sum."""
    values = sorted(v for v in samples if v is not None)
    cumulative = [(str(float(b)), bisect_right(values, b)) for b in buckets] + [("+Inf", len(values))]
    family.add_metric(labels, cumulative, sum_value=sum(values))
    return family


def free_slots(w) -> int:
    """A live worker's slots free for a job now (none while draining or under disk pressure)."""
    if w.state == "draining" or w.pressure:
        return 0
    if (w.max_jobs or 1) <= 1:
        return w.slots if w.state == "idle" and w.current_job is None else 0
    return max(0, w.slots - (w.busy_slots or 0))


def by_device(name: str, documentation: str, live: list[Worker], value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["device"])
    for device in ("cuda", "cpu"):
        family.add_metric([device], sum(value(w) for w in live if w.device == device))
    return family


def elapsed_s(db: Session, start, end):
    """end - start in seconds, in SQL (NULL if either is): PostgreSQL's interval, SQLite's julian days."""
    if db.get_bind().dialect.name == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86400.0
    return cast(func.extract("epoch", end - start), Float)  # numeric (a Decimal) on PostgreSQL 14 and later


def seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start and end else None


class ServiceCollector(Collector):
    """Reads the database and Redis on every scrape."""

    def __init__(self, factory: sessionmaker[Session], redis: Redis, prefix: str, lost_after_s: float = 10.0):
        self.factory, self.redis, self.prefix = factory, redis, prefix
        self.lost_after_s = lost_after_s  # a worker silent for the lease is not live (service/workers/)

    def collect(self) -> Iterable[Metric]:
        with self.factory() as db:
            yield from self.collect_db(db)
        yield from self.collect_redis()

    def collect_db(self, db: Session) -> Iterable[Metric]:
        kept = job_counts.by_status_and_priority(db)  # kept as jobs change: never a count over every job
        jobs = GaugeMetricFamily("trainjobs_jobs", "Jobs by status", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], sum(n for (s, _), n in kept.items() if s == status.value))
        yield jobs
        queued = {p: n for (s, p), n in kept.items() if s == JobStatus.QUEUED.value}
        waiting = GaugeMetricFamily("trainjobs_jobs_queued", "Queued jobs by priority (the database's count, "
                                    "whether or not Redis holds them)", labels=["priority"])
        for priority in queue.PRIORITIES:
            waiting.add_metric([priority], queued.get(priority, 0))
        yield waiting
        # NOTE: the highest metrics.id, not count(*): an index lookup where a count reads every row (~0.1 s per
        # million on PostgreSQL, each scrape). Rows are never deleted, so it only grows: a counter, for rate().
        # It also counts the ids of a batch that was rolled back (a database blip; the batch is shipped again).
        points = db.scalar(select(func.max(MetricRow.id))) or 0
        yield CounterMetricFamily("trainjobs_metric_points_ingested", "Metric points ingested (all jobs; ids "
                                  "of rolled-back batches included)", value=points)
        live = workers.live(db, lost_after_s=self.lost_after_s)
        yield by_device("trainjobs_workers", "Live workers (heard from within the lease) by device", live,
                        lambda w: 1)
        yield by_device("trainjobs_worker_slots", "Slots (GPUs; processes on CPU) of live workers", live,
                        lambda w: w.slots)
        # A draining worker, or one under disk pressure, takes none; a worker of one job at a time has none free
        # while it runs one; a shared worker (max_jobs > 1) the slots its holds leave.
        yield by_device("trainjobs_worker_slots_free", "Slots of live workers free for a job", live, free_slots)
        devices = GaugeMetricFamily("trainjobs_worker_devices", "Devices (GPUs, or CPU slots) of live workers by "
                                    "state: free, held by a job, unhealthy", labels=["device", "state"])
        held = holds.all_held(db)
        counts: dict[tuple[str, str], int] = {}
        for w in live:
            for d in w.devices or [{"index": i, "healthy": True} for i in range(w.slots)]:
                state = ("held" if d["index"] in held.get(w.id, {}) else
                         "free" if d.get("healthy", True) else "unhealthy")
                counts[w.device, state] = counts.get((w.device, state), 0) + 1
        for device in sorted({w.device for w in live}):
            for state in ("free", "held", "unhealthy"):
                devices.add_metric([device, state], counts.get((device, state), 0))
        yield devices
        # NOTE: the seconds computed by the database: 1,000 rows of two floats, where three datetimes a row cost
        # the scrape most of its Python.
        recent = db.execute(
            select(Job.status, elapsed_s(db, Job.created_at, Job.started_at).label("wait"),
                   elapsed_s(db, Job.started_at, Job.finished_at).label("duration"))
            .where(Job.started_at.is_not(None)).order_by(Job.id.desc()).limit(LATENCY_WINDOW)
        ).all()
        waits = HistogramMetricFamily("trainjobs_job_wait_seconds",
                                      f"Submit to claim, last {LATENCY_WINDOW} started jobs")
        yield add_samples(waits, [], (r.wait for r in recent), WAIT_BUCKETS)
        durations = HistogramMetricFamily("trainjobs_job_duration_seconds",
                                          f"Claim to end, last {LATENCY_WINDOW} started jobs", labels=["status"])
        by_status: dict[str, list[float | None]] = {}
        for r in recent:
            by_status.setdefault(r.status, []).append(r.duration)
        for status in sorted(s for s in by_status if JobStatus(s).is_terminal()):
            add_samples(durations, [status], by_status[status], DURATION_BUCKETS)
        yield durations
        pending, oldest = outbox.backlog(db)
        yield GaugeMetricFamily("trainjobs_webhook_deliveries_pending", "Webhook events not yet delivered nor "
                                "given up (every webhook's)", value=pending)
        yield GaugeMetricFamily("trainjobs_webhook_oldest_pending_seconds", "Age of the oldest undelivered webhook "
                                "event (0: none): a receiver down, or deliveries falling behind",
                                value=seconds(oldest, utcnow()) if oldest is not None else 0)

    def collect_redis(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("trainjobs_queue_depth", "Jobs waiting in each RQ queue", labels=["priority"])
        try:
            for priority in queue.PRIORITIES:
                depth.add_metric([priority], queue.get_queue(self.redis, self.prefix, priority).count)
        except RedisError:
            log.warning("cannot read the queue depths from Redis")
            return  # no families rather than zeros that look true; and no second wait on a dead Redis
        yield depth


class RequestLatency:
    """ASGI middleware: request latency by route template, method and status class."""

    def __init__(self, app: ASGIApp, histogram: Histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, stream, start = 500, False, time.perf_counter()

        async def record_status(message: Message) -> None:
            nonlocal status, stream
            if message["type"] == "http.response.start":
                status = message["status"]
                stream = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"])
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            # An event stream lasts as long as its job: no request latency to speak of.
            if not stream:
                # The template, not the path, so job ids do not blow up the label set.
                route = getattr(scope.get("route"), "path", "unmatched")
                self.histogram.labels(route, scope["method"], f"{status // 100}xx").observe(
                    time.perf_counter() - start)


def install(app: FastAPI) -> None:
    """A registry per app (tests build many apps), its collector and the request middleware."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(app.state.sessionmaker, app.state.redis, app.state.settings.queue_prefix,
                                       app.state.settings.lease_s))
    requests = Histogram("trainjobs_http_request_duration_seconds", "API request latency",
                         ["route", "method", "status"], registry=registry)
    deleted = Counter("trainjobs_gc_deleted", "What retention deleted in this process's sweeper (jobs touched, "
                      "log chunks, metric points, events, folders, store objects); `trainjobs gc` prints its own",
                      ["kind"], registry=registry)
    app.state.count_collected = lambda done: [deleted.labels(kind).inc(n) for kind, n in done.as_dict().items()]
    app.state.prometheus = registry
    app.add_middleware(RequestLatency, histogram=requests)
    app.include_router(router, dependencies=[Depends(current_principal)])  # a token, like /v1


@router.get("/metrics", include_in_schema=False)
def scrape(request: Request) -> Response:
    return Response(generate_latest(request.app.state.prometheus), media_type=CONTENT_TYPE_LATEST)
