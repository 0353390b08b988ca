"""Write metric batches, read them back as series (whole, or thinned for a chart)."""

import struct
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import chain, groupby, repeat

from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from service.metrics import blocks
from service.metrics.downsample import downsample
from service.metrics.models import Metric, MetricBlock

# The columns a point is written with, and their PostgreSQL types for a binary COPY (in this order).
COPY_COLUMNS = ("job_id", "attempt", "node_rank", "step", "name", "value", "time")
COPY_TYPES = ("text", "int4", "int4", "int4", "text", "float8", "timestamptz")
# A binary COPY's framing (PostgreSQL's "COPY" page, "Binary Format"), and where its timestamps count from.
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def insert_batch(
    db: Session, *, job_id: str, attempt: int, rows: Iterable[tuple[int, str, float, datetime]], node_rank: int = 0
) -> int:
    """Insert (step, name, value, time) rows of one node, and update their block summaries.

    PostgreSQL: one binary COPY (copy_points); SQLite: one executemany. Either in the session's transaction.
    """
    rows = rows if isinstance(rows, list) else list(rows)
    if not rows:
        return 0
    if db.get_bind().dialect.name == "postgresql":
        copy_points(db, job_id=job_id, attempt=attempt, node_rank=node_rank, rows=rows)
    else:
        db.execute(insert(Metric), [
            {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "step": step, "name": name,
             "value": value, "time": t} for step, name, value, t in rows])
    blocks.record(db, job_id=job_id, node_rank=node_rank, rows=((step, name, value) for step, name, value, _ in rows))
    return len(rows)


def copy_points(db: Session, *, job_id: str, attempt: int, node_rank: int,
                rows: list[tuple[int, str, float, datetime]]) -> None:
    """The rows by PostgreSQL's COPY on the session's own connection (so in its transaction): per point a few
    microseconds of the database's CPU, where a multi-row INSERT parses, plans and binds 7 parameters a point.

    NOTE: the driver's connection is reached under SQLAlchemy, which neither sees the statement nor wraps its
    errors: they are wrapped here as SQLAlchemy would (a lost connection is an OperationalError and is invalidated,
    data the database refuses a DataError), so callers tell an outage from a refusal as for any statement.
    """
    def write(copy) -> None:
        copy.set_types(COPY_TYPES)
        for step, name, value, t in rows:
            copy.write_row((job_id, attempt, node_rank, step, name, value, t))

    _copy(db, write)


def _copy(db: Session, write) -> None:
    """`write(copy)` inside a binary COPY into metrics on the session's connection, its errors wrapped (above)."""
    conn = db.connection()
    statement = f"COPY metrics ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    driver = conn.connection.driver_connection  # psycopg 3's Connection, inside the session's transaction
    try:
        with driver.cursor() as cursor, cursor.copy(statement) as copy:
            write(copy)
    except conn.dialect.loaded_dbapi.Error as exc:
        lost = conn.dialect.is_disconnect(exc, driver, None)
        if lost:
            conn.invalidate(exc)
        raise DBAPIError.instance(statement, None, exc, conn.dialect.loaded_dbapi.Error,
                                  connection_invalidated=lost, dialect=conn.dialect) from exc


def insert_points(db: Session, *, job_id: str, attempt: int, node_rank: int, steps: Sequence[int],
                  names: Sequence[str], name_index: Sequence[int], values: Sequence[float],
                  times: Sequence[float]) -> int:
    """Insert one node's points by column, as a worker ships them (service/runners/points.py): point i is
    (steps[i], names[name_index[i]], values[i], times[i] in unix seconds); and update their block summaries.

    PostgreSQL: one binary COPY whose bytes are packed in a single struct.pack (copy_columns), not a Python call a
    row. SQLite: one executemany. The rows are those insert_batch writes of the same points (times to the
    microsecond as datetime.fromtimestamp reads them). Either in the session's transaction.
    """
    if not len(steps):
        return 0
    at = {t: datetime.fromtimestamp(t, UTC) for t in set(times)}  # a step's points share their time: few
    if db.get_bind().dialect.name == "postgresql":
        micros = {t: (moment - PG_EPOCH) // MICROSECOND for t, moment in at.items()}
        copy_columns(db, job_id=job_id, attempt=attempt, node_rank=node_rank, steps=steps, names=names,
                     name_index=name_index, values=values, micros=list(map(micros.__getitem__, times)))
    else:
        db.execute(insert(Metric), [
            {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "step": step, "name": names[i],
             "value": value, "time": at[t]}
            for step, i, value, t in zip(steps, name_index, values, times, strict=True)])
    blocks.record_columns(db, job_id=job_id, node_rank=node_rank, steps=steps, names=names, name_index=name_index,
                          values=values)
    return len(steps)


def copy_columns(db: Session, *, job_id: str, attempt: int, node_rank: int, steps: Sequence[int],
                 names: Sequence[str], name_index: Sequence[int], values: Sequence[float],
                 micros: Sequence[int]) -> None:
    """Points by column as one binary COPY (COPY_COLUMNS' order; a time in microseconds from 2000-01-01 UTC).

    Each row's bytes are its fixed head (field count, job, attempt, node, the step's length), its step, its name's
    chunk (length, UTF-8, the value's length), its value, the time's length and its time: one format piece per
    name, joined in the points' order, packs the whole batch in one call at C speed (~0.5 µs a point; write_row ~1).
    """
    data = _packed(job_id=job_id, attempt=attempt, node_rank=node_rank, steps=steps, names=names,
                   name_index=name_index, values=values, micros=micros)

    def write(copy) -> None:
        for part in (COPY_HEADER, data, COPY_TRAILER):
            copy.write(part)

    _copy(db, write)


def _packed(*, job_id: str, attempt: int, node_rank: int, steps: Sequence[int], names: Sequence[str],
            name_index: Sequence[int], values: Sequence[float], micros: Sequence[int]) -> bytes:
    """One node's points as the rows of a binary COPY (copy_columns), without its header and trailer."""
    job = job_id.encode()
    head = struct.pack(">hi", len(COPY_COLUMNS), len(job)) + job + struct.pack(">iiiii", 4, attempt, 4, node_rank, 4)
    chunks = [struct.pack(">i", len(raw)) + raw + struct.pack(">i", 8) for raw in (name.encode() for name in names)]
    pieces = [f"{len(head)}si{len(chunk)}sdiq" for chunk in chunks]
    layout = ">" + "".join(map(pieces.__getitem__, name_index))
    return struct.pack(layout, *chain.from_iterable(zip(repeat(head), steps, map(chunks.__getitem__, name_index),
                                                        values, repeat(8), micros)))


# One node's points by column, as insert_points takes them: (job_id, attempt, node_rank, steps, names, name_index,
# values, times in unix seconds).
PointBatch = tuple[str, int, int, Sequence[int], Sequence[str], Sequence[int], Sequence[float], Sequence[float]]


def insert_points_many(db: Session, batches: list[PointBatch]) -> int:
    """insert_points of several nodes' batches (a worker's tick), each node once, in the session's transaction: on
    PostgreSQL one binary COPY of all their points and one read and one upsert of all their blocks
    (blocks.record_many). The rows are those insert_points writes of each batch, in the batches' order."""
    batches = [batch for batch in batches if len(batch[3])]
    if not batches:
        return 0
    at = {t: datetime.fromtimestamp(t, UTC) for t in set(chain.from_iterable(batch[7] for batch in batches))}
    if db.get_bind().dialect.name == "postgresql":
        micros = {t: (moment - PG_EPOCH) // MICROSECOND for t, moment in at.items()}
        parts = [_packed(job_id=job_id, attempt=attempt, node_rank=node_rank, steps=steps, names=names,
                         name_index=name_index, values=values, micros=list(map(micros.__getitem__, times)))
                 for job_id, attempt, node_rank, steps, names, name_index, values, times in batches]

        def write(copy) -> None:
            for part in (COPY_HEADER, *parts, COPY_TRAILER):
                copy.write(part)

        _copy(db, write)
    else:
        db.execute(insert(Metric), [
            {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "step": step, "name": names[i],
             "value": value, "time": at[t]}
            for job_id, attempt, node_rank, steps, names, name_index, values, times in batches
            for step, i, value, t in zip(steps, name_index, values, times, strict=True)])
    blocks.record_many(db, [(job_id, node_rank, steps, names, name_index, values)
                            for job_id, _, node_rank, steps, names, name_index, values, _ in batches])
    return sum(len(batch[3]) for batch in batches)


def stored(db: Session, *, job_id: str, node_rank: int = 0) -> tuple[set[str], int]:
    """The names a job's node has stored points under, and how many points (one per step and name): what its
    earlier attempts used of the per-job caps. From the block summaries: a read of points / BLOCK_STEPS rows."""
    rows = db.execute(select(MetricBlock.name, func.sum(MetricBlock.points)).where(
        MetricBlock.job_id == job_id, MetricBlock.node_rank == node_rank).group_by(MetricBlock.name)).all()
    return {name for name, _ in rows}, sum(int(points or 0) for _, points in rows)


def replace_samples(
    db: Session, *, job_id: str, attempt: int, rows: list[tuple[int, str, float, datetime]], node_rank: int = 0
) -> int:
    """Insert sampled points (a worker's usage readings), keeping one per series, step and attempt: the latest.

    Samples come by the clock, not by the step: a slow (or stuck) step would otherwise keep a row per sample,
    and its block be recomputed from all of them on every write.
    """
    for step in {step for step, _, _, _ in rows}:
        names = sorted({name for s, name, _, _ in rows if s == step})
        for i in range(0, len(names), blocks.IN_CHUNK):
            db.execute(delete(Metric).where(Metric.job_id == job_id, Metric.node_rank == node_rank,
                                            Metric.attempt == attempt, Metric.step == step,
                                            Metric.name.in_(names[i:i + blocks.IN_CHUNK])))
    return insert_batch(db, job_id=job_id, attempt=attempt, rows=rows, node_rank=node_rank)


def stream_cursor(db: Session, *, job_id: str) -> int:
    """The highest metrics.id of the job's series (node 0's): GET .../events with it as Last-Event-ID sends
    only points written after it. An index lookup (ix_metrics_job_node_id), however long the series."""
    return db.scalar(select(func.max(Metric.id)).where(Metric.job_id == job_id, Metric.node_rank == 0)) or 0


def newest_point(db: Session, *, job_id: str, node_rank: int) -> int:
    """The highest metrics.id of node_rank's series, 0 for none: the version of a chart of them."""
    return db.scalar(select(func.max(Metric.id)).where(Metric.job_id == job_id, Metric.node_rank == node_rank)) or 0


def read_series(
    db: Session, *, job_id: str, name: str | None = None, after_step: int | None = None, node_rank: int = 0,
    names: list[str] | None = None,
) -> list[dict]:
    """The job's series (or `name`'s, or those in `names`), every point."""
    query = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id,
                                                                 Metric.node_rank == node_rank)
    if name is not None:
        query = query.where(Metric.name == name)
    if names is not None:
        if not names:
            return []
        query = query.where(Metric.name.in_(names))
    if after_step is not None:
        query = query.where(Metric.step > after_step)
    series: dict[str, dict] = {}
    # A resumed attempt repeats the steps after its checkpoint: the latest attempt's value wins.
    for metric_name, step, value in db.execute(query.order_by(Metric.name, Metric.step, Metric.attempt, Metric.id)):
        entry = series.setdefault(metric_name, {"name": metric_name, "steps": [], "values": []})
        if entry["steps"] and entry["steps"][-1] == step:
            entry["values"][-1] = value
            continue
        entry["steps"].append(step)
        entry["values"].append(value)
    return list(series.values())


def read_thinned(db: Session, *, job_id: str, max_points: int, name: str | None = None,
                 after_step: int | None = None, node_rank: int = 0) -> list[dict]:
    """Every series (or `name`) thinned to at most max_points: min and max per bucket and the last point.

    A series with at least one block per bucket is thinned from its block summaries (a first block that
    after_step cuts, from its points); a shorter one from its points, by downsample().
    """
    buckets = (max_points - 1) // 2
    if after_step is None and max_points >= 3:  # whole blocks only: the database thins the long series
        blocks_of = blocks.counts(db, job_id=job_id, node_rank=node_rank, name=name)
        if not blocks_of:  # NOTE: points written around insert_batch (a bulk load) have no summaries
            return thin_points(db, job_id=job_id, node_rank=node_rank, name=name, after_step=None,
                               max_points=max_points)
        long = [series_name for series_name, count in blocks_of.items() if count >= buckets]
        thinned = blocks.thin_in_database(db, job_id=job_id, node_rank=node_rank, names=long,
                                          max_points=max_points) if long else {}
        from_points = {entry["name"]: entry for entry in thin_points(  # every short series in one read
            db, job_id=job_id, node_rank=node_rank, names=[n for n in blocks_of if n not in thinned], after_step=None,
            max_points=max_points)}
        # NOTE: a short series whose points retention deleted (service/jobs/retention.py) draws from its
        # summaries: coarser (min, max and last per 256 steps), but still there.
        gone = [n for n in blocks_of if n not in thinned and n not in from_points]
        if gone:
            thinned |= blocks.thin_in_database(db, job_id=job_id, node_rank=node_rank, names=gone,
                                               max_points=max_points)
        return [from_points.get(series_name) or {"name": series_name, "steps": thinned[series_name][1],
                                                 "values": thinned[series_name][2]}
                for series_name in blocks_of]
    query = select(MetricBlock.name, MetricBlock.block, MetricBlock.points, MetricBlock.last_step,
                   MetricBlock.last_value, MetricBlock.min_step, MetricBlock.min_value, MetricBlock.max_step,
                   MetricBlock.max_value).where(MetricBlock.job_id == job_id, MetricBlock.node_rank == node_rank)
    if name is not None:
        query = query.where(MetricBlock.name == name)
    cut = None if after_step is None else after_step // blocks.BLOCK_STEPS  # the block after_step falls in
    if cut is not None:
        query = query.where(MetricBlock.block >= cut)
    found = db.execute(query.order_by(MetricBlock.name, MetricBlock.block)).all()
    if not found:  # NOTE: points written around insert_batch (a bulk load) have no summaries: use the points
        return thin_points(db, job_id=job_id, node_rank=node_rank, name=name, after_step=after_step,
                           max_points=max_points)
    series = []
    for series_name, group in groupby(found, lambda row: row.name):
        rows: list = list(group)  # each row has a Summary's fields
        if max_points < 3 or len(rows) < buckets:
            series += thin_points(db, job_id=job_id, node_rank=node_rank, name=series_name, after_step=after_step,
                                  max_points=max_points)
            continue
        if rows[0].block == cut:
            points = blocks.block_points(db, job_id=job_id, node_rank=node_rank, name=series_name, block=cut,
                                         after_step=after_step)
            rows[:1] = [blocks.summarize(points)] if points else []
        if rows:
            steps, values = blocks.thin(rows, max_points)
            series.append({"name": series_name, "steps": steps, "values": values})
    return series


def thin_points(db: Session, *, job_id: str, after_step: int | None, max_points: int, name: str | None = None,
                names: list[str] | None = None, node_rank: int = 0) -> list[dict]:
    series = read_series(db, job_id=job_id, node_rank=node_rank, name=name, names=names, after_step=after_step)
    for entry in series:
        entry["steps"], entry["values"] = downsample(entry["steps"], entry["values"], max_points)
    return series


def shipped_rows(points: Iterable[Sequence]) -> list[tuple[int, str, float, datetime]]:
    """Points as a worker ships them, (step, name, value, unix time) (service/runners/ship_calls.py), as rows for
    insert_batch. A step's points share their time: each time is converted once."""
    times: dict[float, datetime] = {}
    return [(step, name, value, times.get(at) or times.setdefault(at, datetime.fromtimestamp(at, UTC)))
            for step, name, value, at in points]


def insert_shipped(db: Session, *, job_id: str, attempt: int, points: Iterable[Sequence], node_rank: int = 0) -> int:
    """insert_points of points as a worker ships them in rows, (step, name, value, unix time)."""
    steps, names, name_index, values, times = shipped_columns(points)
    return insert_points(db, job_id=job_id, attempt=attempt, node_rank=node_rank, steps=steps, names=names,
                         name_index=name_index, values=values, times=times)


def shipped_columns(points: Iterable[Sequence]) -> tuple[Sequence[int], list[str], list[int], Sequence[float],
                                                            Sequence[float]]:
    """Rows (step, name, value, unix time) as insert_points' columns: steps, names, name_index, values, times."""
    steps, names, values, times = list(zip(*points, strict=True)) or ((), (), (), ())
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}
    return steps, list(index), list(map(index.__getitem__, names)), values, times
