"""Block summaries: each series cut into blocks of BLOCK_STEPS steps, each kept as (points, min, max, last).

Why: thinning a 1M-point series for a chart (max_points) from its points reads a million rows, ~0.5 s on
PostgreSQL before Python touches them; from summaries it reads 1M / 256 rows. Every batch of points written
updates its blocks in the same transaction, so a summary is exact for the series the API serves (a step's
latest attempt wins): steps past a block's last merge into it; steps it already holds (a retry that resumed
from a checkpoint) make it be recomputed from its rows.
"""

import operator
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, groupby, repeat

from sqlalchemy import Row, case, func, or_, select, text, tuple_
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.metrics.models import Metric, MetricBlock

BLOCK_STEPS = 256
SHIFT = BLOCK_STEPS.bit_length() - 1  # step >> SHIFT is its block
BLOCK_MASK = (1 << (32 - SHIFT)) - 1
STEP_MASK = (1 << 32) - 1
IN_CHUNK = 500  # (name, block) pairs per IN list
KEY_FIELDS = ("job_id", "node_rank", "name", "block")
SUMMARY_FIELDS = ("points", "last_step", "last_value", "min_step", "min_value", "max_step", "max_value")


@dataclass
class Summary:
    points: int
    last_step: int
    last_value: float
    min_step: int
    min_value: float
    max_step: int
    max_value: float


def summarize(points: Sequence[tuple[int, float]]) -> Summary:
    """The summary of (step, value) pairs in increasing step order, each step once; ties go to the first step."""
    low = min(points, key=lambda p: p[1])
    high = max(points, key=lambda p: p[1])
    return Summary(len(points), points[-1][0], points[-1][1], low[0], low[1], high[0], high[1])


def merge(row: Summary, new: Summary) -> None:
    """Fold a summary of later steps into a block's."""
    row.points += new.points
    row.last_step, row.last_value = new.last_step, new.last_value
    if new.min_value < row.min_value:
        row.min_step, row.min_value = new.min_step, new.min_value
    if new.max_value > row.max_value:
        row.max_step, row.max_value = new.max_step, new.max_value


def block_points(db: Session, *, job_id: str, name: str, block: int, after_step: int | None = None,
                 node_rank: int = 0) -> list[tuple[int, float]]:
    """A block's points as the API serves them: one per step, the latest attempt's (then the latest row's)."""
    lo = block * BLOCK_STEPS if after_step is None else max(block * BLOCK_STEPS, after_step + 1)
    rows = db.execute(select(Metric.step, Metric.value).where(
        Metric.job_id == job_id, Metric.node_rank == node_rank, Metric.name == name, Metric.step >= lo,
        Metric.step < (block + 1) * BLOCK_STEPS,
    ).order_by(Metric.step, Metric.attempt, Metric.id))
    return sorted({step: value for step, value in rows}.items())


def record(db: Session, *, job_id: str, rows: Iterable[tuple[int, str, float]], node_rank: int = 0) -> None:
    """record_columns of (step, name, value) rows."""
    steps, names, values = list(zip(*rows, strict=True)) or ((), (), ())
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}
    record_columns(db, job_id=job_id, node_rank=node_rank, steps=steps, names=list(index),
                   name_index=list(map(index.__getitem__, names)), values=values)


def record_columns(db: Session, *, job_id: str, node_rank: int, steps: Sequence[int], names: Sequence[str],
                   name_index: Sequence[int], values: Sequence[float]) -> None:
    """Update the blocks of one node's points just inserted (same transaction, after the insert); point i is
    (steps[i], names[name_index[i]], values[i]).

    Two statements however many blocks a batch touches: one read of their summaries, one upsert of the new ones
    (a ship of one step of ten series once cost ten UPDATEs, one a block). The points are keyed (name, step) in
    one integer, deduplicated by a dict (the later point of a step wins) and sorted, so each block is a slice found
    by bisection and summarized by min and max at C speed: no Python statement a point.
    """
    if not len(steps):
        return
    keys, values, batches = _blocks_of(steps, names, name_index, values)
    existing = _read(db, job_id=job_id, node_rank=node_rank, keys=list(batches))
    _write(db, _summaries(db, job_id=job_id, node_rank=node_rank, keys=keys, values=values, batches=batches,
                          existing=existing))


def record_many(db: Session, nodes: list[tuple[str, int, Sequence[int], Sequence[str], Sequence[int],
                                               Sequence[float]]]) -> None:
    """record_columns of several nodes' points (a worker's tick), each (job_id, node_rank, steps, names,
    name_index, values) and each node once: on PostgreSQL one read and one upsert for all their blocks, the
    summaries record_columns would write for each."""
    nodes = [node for node in nodes if len(node[2])]
    if db.get_bind().dialect.name != "postgresql":  # one machine's embedded database: node by node
        for job_id, node_rank, steps, names, name_index, values in nodes:
            record_columns(db, job_id=job_id, node_rank=node_rank, steps=steps, names=names, name_index=name_index,
                           values=values)
        return
    if not nodes:
        return
    cut = [(job_id, node_rank, *_blocks_of(steps, names, name_index, values))
           for job_id, node_rank, steps, names, name_index, values in nodes]
    wanted = [(job_id, node_rank, name, block) for job_id, node_rank, _, _, batches in cut for name, block in batches]
    rows = db.execute(PG_READ_MANY, {f"{f}s": [key[i] for key in wanted] for i, f in enumerate(KEY_FIELDS)})
    existing: dict[tuple[str, int], dict] = {}
    for row in rows:
        existing.setdefault((row[0], row[1]), {})[(row[2], row[3])] = Summary(*row[4:])
    summaries = list(chain.from_iterable(
        _summaries(db, job_id=job_id, node_rank=node_rank, keys=keys, values=values, batches=batches,
                   existing=existing.get((job_id, node_rank), {})) for job_id, node_rank, keys, values, batches in cut))
    db.execute(PG_UPSERT_MANY, {f: [row[f] for row in summaries] for f in KEY_FIELDS + SUMMARY_FIELDS})


def _blocks_of(steps: Sequence[int], names: Sequence[str], name_index: Sequence[int], values: Sequence[float]
               ) -> tuple[list[int], list[float], dict[tuple[str, int], tuple[int, int]]]:
    """The points keyed (name << 32 | step), deduplicated (the later point of a step wins) and sorted, their values,
    and each (name, block)'s slice of them."""
    # key = name << 32 | step (a step is below 2^31), so key >> SHIFT is (name, block) and sorting puts each
    # block's steps together, in order.
    latest = dict(zip(map(operator.or_, map(operator.lshift, name_index, repeat(32)), steps), values, strict=True))
    keys = sorted(latest)
    ordered = list(map(latest.__getitem__, keys))
    batches, start = {}, 0
    while start < len(keys):
        group = keys[start] >> SHIFT
        end = bisect_left(keys, (group + 1) << SHIFT, start)
        batches[(names[group >> (32 - SHIFT)], group & BLOCK_MASK)] = (start, end)
        start = end
    return keys, ordered, batches


def _summaries(db: Session, *, job_id: str, node_rank: int, keys: list[int], values: list[float],
               batches: dict[tuple[str, int], tuple[int, int]], existing: dict[tuple[str, int], Summary]
               ) -> list[dict]:
    """The new summaries of one node's blocks: the stored ones merged with the points' (or recomputed)."""
    summaries = []
    for (name, block), (start, end) in batches.items():
        new = _summarize_slice(keys, values, start, end)
        summary = existing.get((name, block))
        if summary is None:
            summary = new
        elif keys[start] & STEP_MASK > summary.last_step:
            merge(summary, new)
        else:  # NOTE: steps seen before (a retry): their old values may be the block's min or max
            summary = summarize(block_points(db, job_id=job_id, node_rank=node_rank, name=name, block=block))
        summaries.append({"job_id": job_id, "node_rank": node_rank, "name": name, "block": block, **vars(summary)})
    return summaries


# On PostgreSQL a batch's blocks go as arrays through statements of one text each (a statement whose text varies with
# the count of blocks, an IN list of pairs or a multi-row VALUES, was rendered by SQLAlchemy and parsed by psycopg
# afresh for every batch: ~1 µs of the API's CPU a point of a 10,000-point batch).
PG_READ = text(f"""SELECT b.name, b.block, {", ".join(f"b.{f}" for f in SUMMARY_FIELDS)} FROM metric_blocks b
JOIN unnest(CAST(:names AS text[]), CAST(:blocks AS int[])) AS k(name, block) ON b.name = k.name AND b.block = k.block
WHERE b.job_id = :job_id AND b.node_rank = :node_rank""")
PG_TYPES = {"points": "int", "last_step": "int", "last_value": "float8", "min_step": "int", "min_value": "float8",
            "max_step": "int", "max_value": "float8"}
PG_UPSERT = text(f"""INSERT INTO metric_blocks ({", ".join(KEY_FIELDS + SUMMARY_FIELDS)})
SELECT :job_id, :node_rank, * FROM unnest(CAST(:name AS text[]), CAST(:block AS int[]),
{", ".join(f"CAST(:{f} AS {PG_TYPES[f]}[])" for f in SUMMARY_FIELDS)})
ON CONFLICT ({", ".join(KEY_FIELDS)}) DO UPDATE SET {", ".join(f"{f} = excluded.{f}" for f in SUMMARY_FIELDS)}""")
# The same for several nodes' blocks at once (record_many): the keys' every field an array.
PG_READ_MANY = text(f"""SELECT b.job_id, b.node_rank, b.name, b.block, {", ".join(f"b.{f}" for f in SUMMARY_FIELDS)}
FROM metric_blocks b JOIN unnest(CAST(:job_ids AS text[]), CAST(:node_ranks AS int[]), CAST(:names AS text[]),
CAST(:blocks AS int[])) AS k(job_id, node_rank, name, block)
ON b.job_id = k.job_id AND b.node_rank = k.node_rank AND b.name = k.name AND b.block = k.block""")
PG_UPSERT_MANY = text(f"""INSERT INTO metric_blocks ({", ".join(KEY_FIELDS + SUMMARY_FIELDS)})
SELECT * FROM unnest(CAST(:job_id AS text[]), CAST(:node_rank AS int[]), CAST(:name AS text[]), CAST(:block AS int[]),
{", ".join(f"CAST(:{f} AS {PG_TYPES[f]}[])" for f in SUMMARY_FIELDS)})
ON CONFLICT ({", ".join(KEY_FIELDS)}) DO UPDATE SET {", ".join(f"{f} = excluded.{f}" for f in SUMMARY_FIELDS)}""")


def _read(db: Session, *, job_id: str, node_rank: int, keys: list[tuple[str, int]]) -> dict[tuple[str, int], Summary]:
    """The stored summaries of these (name, block)s."""
    if db.get_bind().dialect.name == "postgresql":
        rows = db.execute(PG_READ, {"job_id": job_id, "node_rank": node_rank, "names": [n for n, _ in keys],
                                    "blocks": [b for _, b in keys]})
        return {(row[0], row[1]): Summary(*row[2:]) for row in rows}
    existing = {}
    for i in range(0, len(keys), IN_CHUNK):  # NOTE: ~8,000 pairs in one IN list exceed a database's stack depth
        existing |= {(b.name, b.block): Summary(*b[2:]) for b in db.execute(select(
            MetricBlock.name, MetricBlock.block, *(getattr(MetricBlock, f) for f in SUMMARY_FIELDS)).where(
            MetricBlock.job_id == job_id, MetricBlock.node_rank == node_rank,
            tuple_(MetricBlock.name, MetricBlock.block).in_(keys[i:i + IN_CHUNK])))}
    return existing


def _write(db: Session, summaries: list[dict]) -> None:
    """Insert or replace these summaries (one node's: each dict holds KEY_FIELDS and SUMMARY_FIELDS)."""
    if db.get_bind().dialect.name == "postgresql":
        first = summaries[0]
        db.execute(PG_UPSERT, {"job_id": first["job_id"], "node_rank": first["node_rank"],
                               **{f: [row[f] for row in summaries] for f in ("name", "block", *SUMMARY_FIELDS)}})
        return
    upsert = sqlite_insert(MetricBlock)
    db.execute(upsert.on_conflict_do_update(index_elements=KEY_FIELDS,
                                            set_={f: upsert.excluded[f] for f in SUMMARY_FIELDS}), summaries)


def _summarize_slice(keys: list[int], values: list[float], start: int, end: int) -> Summary:
    """summarize() of one block's points keys[start:end] (in step order, each step once) and their values."""
    part = values[start:end]
    low, high = min(part), max(part)
    at_low, at_high = start + part.index(low), start + part.index(high)  # the first step holding each: as summarize
    return Summary(end - start, keys[end - 1] & STEP_MASK, values[end - 1], keys[at_low] & STEP_MASK, low,
                   keys[at_high] & STEP_MASK, high)


def thin(blocks: Sequence[Summary | Row], max_points: int) -> tuple[list[int], list[float]]:
    """At most max_points points from consecutive blocks, as downsample() cuts points: buckets of about equal
    point counts, the min and max of each (whole blocks per bucket), and the last point."""
    buckets = max(1, (max_points - 1) // 2)
    body = max(1, sum(b.points for b in blocks) - 1)
    groups: list[list] = [[] for _ in range(buckets)]
    first = 0  # the index of a block's first point in the series
    for b in blocks:
        groups[min(buckets - 1, first * buckets // body)].append(b)
        first += b.points
    keep: list[tuple[int, float]] = []
    for group in groups:
        if group:
            low = min(group, key=lambda b: b.min_value)
            high = max(group, key=lambda b: b.max_value)
            keep.extend(sorted({(low.min_step, low.min_value), (high.max_step, high.max_value)}))
    last = (blocks[-1].last_step, blocks[-1].last_value)
    if keep and keep[-1][0] == last[0]:
        keep.pop()
    keep.append(last)
    return [s for s, _ in keep], [v for _, v in keep]


def counts(db: Session, *, job_id: str, node_rank: int = 0, name: str | None = None) -> dict[str, int]:
    """Each series' number of blocks, by name (an index range of the primary key)."""
    query = select(MetricBlock.name, func.count()).where(MetricBlock.job_id == job_id,
                                                         MetricBlock.node_rank == node_rank)
    if name is not None:
        query = query.where(MetricBlock.name == name)
    return dict(db.execute(query.group_by(MetricBlock.name).order_by(MetricBlock.name)).all())


def thin_in_database(db: Session, *, job_id: str, names: list[str] | None, max_points: int, node_rank: int = 0
                     ) -> dict[str, tuple[int, list[int], list[float]]]:
    """thin() done by the database, for every series (or those in `names`) of the job: per series, its number of blocks
    and the thinned steps and values. Reads each block once and returns at most max_points rows a series,
    where thin() needs every block's row fetched and walked in Python."""
    buckets = max(1, (max_points - 1) // 2)
    series = (MetricBlock.name,)
    where = [MetricBlock.job_id == job_id, MetricBlock.node_rank == node_rank]
    where += [MetricBlock.name.in_(names)] if names is not None else []
    cumulative = func.sum(MetricBlock.points).over(partition_by=series, order_by=MetricBlock.block)
    total = func.sum(MetricBlock.points).over(partition_by=series)
    numbered = select(
        MetricBlock.name, MetricBlock.block, MetricBlock.last_step, MetricBlock.last_value, MetricBlock.min_step,
        MetricBlock.min_value, MetricBlock.max_step, MetricBlock.max_value,
        # as thin(): a block's bucket is where its first point falls among the series' points
        ((cumulative - MetricBlock.points) * buckets // case((total > 1, total - 1), else_=1)).label("at"),
        func.count().over(partition_by=series).label("blocks"),
        func.max(MetricBlock.block).over(partition_by=series).label("last_block"),
    ).where(*where).subquery()
    bucket = case((numbered.c.at > buckets - 1, buckets - 1), else_=numbered.c.at)
    ranked = select(numbered, func.row_number().over(
        partition_by=(numbered.c.name, bucket), order_by=(numbered.c.min_value, numbered.c.block)).label("low"),
        func.row_number().over(partition_by=(numbered.c.name, bucket),
                               order_by=(numbered.c.max_value.desc(), numbered.c.block)).label("high"),
    ).subquery()
    rows = db.execute(select(ranked).where(or_(ranked.c.low == 1, ranked.c.high == 1,
                                               ranked.c.block == ranked.c.last_block))
                      .order_by(ranked.c.name, ranked.c.block)).all()
    out: dict[str, tuple[int, list[int], list[float]]] = {}
    for series_name, group in groupby(rows, lambda r: r.name):
        keep: list[tuple[int, float]] = []
        rows_of = list(group)
        for row in rows_of:  # in block order, so buckets come in order; a block may be both low and high
            points = ([(row.min_step, row.min_value)] if row.low == 1 else []) + \
                ([(row.max_step, row.max_value)] if row.high == 1 else [])
            keep.extend(sorted(set(points)))
        last = (rows_of[-1].last_step, rows_of[-1].last_value)  # the last block, always selected
        keep = [p for p in keep if p[0] < last[0]] + [last]
        out[series_name] = (rows_of[0].blocks, [s for s, _ in keep], [v for _, v in keep])
    return out
