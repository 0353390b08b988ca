"""A page of GET /v1/workers (issue 42): keyset-paged by worker id, filtered in SQL, read as columns.

The filters are SQL, so that a page of a thousand workers is one index range of the workers table and a page's
holds one `IN` query: no ORM object per worker or hold, and nothing read that the page does not show. A worker's
free devices (healthy, held by no live hold) are counted in SQL from its device rows, which both databases hold
as a JSON array: PostgreSQL's `json_array_elements` and SQLite's `json_each` are the one thing that differs.
"""

from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import ColumnElement, Integer, Row, Select, Text, and_, case, cast, func, or_, select, type_coerce
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from service.db import utcnow
from service.errors import InvalidRequest
from service.lists import in_order, page_of
from service.workers import holds
from service.workers.models import Hold, Worker

WorkerState = Literal["idle", "busy", "draining", "lost"]

# What WorkerPublic shows of a worker (started_at and host_memory_bytes are not shown).
COLUMNS = (Worker.id, Worker.host, Worker.address, Worker.device, Worker.slots, Worker.busy_slots,
           Worker.memory_bytes, Worker.labels, Worker.state, Worker.pressure, Worker.current_job, Worker.max_jobs,
           Worker.devices, Worker.last_seen)


def parse_labels(labels: list[str]) -> list[tuple[str, str]]:
    """`k=v` each (as `trainjobs worker --label` takes them); a 422 naming `label` otherwise."""
    pairs = []
    for label in labels:
        key, eq, value = label.partition("=")
        if not eq or not key:
            raise InvalidRequest(f"label {label[:80]!r} is not key=value", field="label")
        pairs.append((key, value))
    return pairs


def state_is(state: WorkerState, *, since: datetime) -> ColumnElement[bool]:
    """A worker shown in `state`: lost is silent since `since` (never stored: service.shown_state)."""
    if state == "lost":
        return Worker.last_seen < since
    return and_(Worker.state == state, Worker.last_seen >= since)


def free_devices(dialect: str, *, now: datetime, live_held: ColumnElement[int]) -> ColumnElement[int]:
    """A worker's devices that are healthy and held by no live hold, given its count of live holds.

    Where no device can be unhealthy (its rows' text has no `false`: `healthy` is true or absent), that is its
    devices less its live holds, and its rows are not parsed one by one. Else, row by row: its healthy devices,
    plus its unhealthy ones that a live hold takes (looked up for those alone), less its live holds. A worker that
    lists no devices (of an earlier version): its slots less its busy ones."""
    if dialect == "postgresql":
        rows = func.json_array_elements(Worker.devices).table_valued("value").alias("d")
        value = type_coerce(rows.c.value, postgresql.JSON)
        index = value["index"].astext.cast(Integer)
        healthy = func.coalesce(value["healthy"].astext, "true") != "false"
    else:
        rows = func.json_each(Worker.devices).table_valued("value").alias("d")
        index = func.json_extract(rows.c.value, "$.index")
        healthy = func.coalesce(func.json_extract(rows.c.value, "$.healthy"), 1) != 0
    held = (select(Hold.device).select_from(holds.joined())
            .where(Hold.worker_id == Worker.id, Hold.device == index, holds.live_clause(now)).correlate(Worker, rows)
            .exists())
    counted = (select(func.sum(case((healthy, 1), (held, 1), else_=0))).select_from(rows).correlate(Worker)
               .scalar_subquery())
    return case((Worker.devices.is_(None), Worker.slots - Worker.busy_slots),
                (cast(Worker.devices, Text).not_like("%false%"), func.json_array_length(Worker.devices) - live_held),
                else_=func.coalesce(counted, 0) - live_held)


def with_free_devices(query: Select, dialect: str, *, now: datetime, at_least: int) -> Select:
    """`query`'s workers with `at_least` free devices, their live holds counted for the whole pool in one join."""
    live = (select(Hold.worker_id, func.count().label("held")).select_from(holds.joined())
            .where(holds.live_clause(now)).group_by(Hold.worker_id).subquery("live"))
    free = free_devices(dialect, now=now, live_held=func.coalesce(live.c.held, 0))
    return query.outerjoin(live, live.c.worker_id == Worker.id).where(free >= at_least)


def page(db: Session, *, lost_after_s: float, limit: int, cursor: str | None = None,
         states: list[WorkerState] | None = None, labels: list[tuple[str, str]] | None = None,
         min_free_devices: int | None = None) -> tuple[list[Row], str | None]:
    """The workers after `cursor` by id that are in one of `states`, carry every label and have at least
    `min_free_devices` free: at most `limit` rows (COLUMNS) and the next page's cursor (None: the last page)."""
    now = utcnow()
    query = select(*COLUMNS)
    if states:
        since = now - timedelta(seconds=lost_after_s)
        query = query.where(or_(*(state_is(s, since=since) for s in states)))
    for key, value in labels or []:
        query = query.where(Worker.labels[key].as_string() == value)
    if min_free_devices:
        query = with_free_devices(query, db.get_bind().dialect.name, now=now, at_least=min_free_devices)
    return page_of(db.execute(in_order(query, Worker.id, cursor=cursor, limit=limit)).all(), limit=limit)
