"""The live workers as the plan sees them (policy.Node), read as plain columns for the snapshot
(service/scheduling/service.py `snapshot`).

At 1,000 workers a pass read each as an ORM object, decoded each one's device rows (their links: 56 a GPU
machine) and rebuilt its machine for placement: 0.4 s of a 0.7 s snapshot (bench/README.md, "One scheduler's
pass"). Here the rows are columns, the device rows are read as their text, and what a worker's text and holds
give (its machine, free devices, each job's devices) is kept while they stay the same: a worker's device rows
change when its health does, its holds when a job starts or ends on it, so a pass rebuilds only those.
"""

import json
from datetime import timedelta
from typing import Any

from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.scheduling.pool import Node
from service.workers import holds
from service.workers.models import Worker

KEPT = 20_000  # workers' parsed rows kept (several per worker as its holds change), then it starts over

# (worker, kind, its device rows' text, its holds) -> its Node fields for device-level reservations; and
# the text -> the rows it decodes to. Process-wide: every pass of every caller reads the same rows.
_fields: dict[tuple, dict[str, Any]] = {}
_rows: dict[str, list[dict] | None] = {}


def live_nodes(db: Session, *, lost_after_s: float) -> tuple[list[Node], set[str]]:
    """The workers heard from within lost_after_s that take jobs (not draining, not under pressure), by id; and
    the jobs holding devices (a queued one among them is being claimed)."""
    from service.scheduling import service as scheduling  # it calls this module: imported once it is loaded

    since = utcnow() - timedelta(seconds=lost_after_s)
    found = db.execute(select(Worker.id, Worker.device, Worker.slots, Worker.memory_bytes, Worker.labels,
                              Worker.max_jobs, Worker.current_job, Worker.state, Worker.pressure,
                              cast(Worker.devices, Text).label("devices"), Worker.images)
                       .where(Worker.last_seen >= since).order_by(Worker.id)).all()
    # A draining worker takes no more jobs, nor does one under pressure (its disk full) until it recovers.
    live = [w for w in found if w.state != "draining" and not w.pressure]
    devices_held = holds.all_held(db) if any(w.max_jobs > 1 for w in live) else {}
    if len(_fields) > KEPT or len(_rows) > KEPT:
        _fields.clear()
        _rows.clear()
    nodes = []
    for w in live:
        rows = _decoded(w.devices)
        held = devices_held.get(w.id, {})
        load = holds.load_of(held) if w.id in devices_held else None
        fields: dict[str, Any] | None = {}
        if w.max_jobs > 1:
            key = (w.id, w.device, w.devices, tuple(sorted(held.items())))
            fields = _fields.get(key)  # one read: another thread's snapshot may clear the cache meanwhile
            if fields is None:
                fields = _fields[key] = scheduling.devices_of(w.id, w.device, rows, held)
        nodes.append(Node(id=w.id, device=w.device, slots=w.slots, memory_bytes=w.memory_bytes,
                          labels=dict(w.labels or {}), running=w.current_job, images=frozenset(w.images or ()),
                          room=scheduling.room_of(w.slots, w.max_jobs, load, rows), **(fields or {})))
    # Of every worker's holds, a lost or draining one's too: the job is being claimed all the same.
    return nodes, {job for held in devices_held.values() for job, _ in held.values()}


def _decoded(text: str | None) -> list[dict] | None:
    if text is None:
        return None
    rows = _rows.get(text)
    if rows is None:
        rows = _rows[text] = json.loads(text)
    return rows
