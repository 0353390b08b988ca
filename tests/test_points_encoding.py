"""A batch's metric points as packed columns (service/runners/points.py): what they decode to, what is refused and
where, and that either form stores exactly the rows and block summaries the per-row COPY stored before."""

import base64
import json
import math
import struct
from array import array

import pytest
from pydantic import BaseModel, ValidationError
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.jobs import service as jobs
from service.metrics import blocks
from service.metrics import service as metrics
from service.metrics.models import Metric, MetricBlock
from service.runners.points import PACKED_MAX, POINTS_MAX, PointColumns, Points, store_points
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec


class Body(BaseModel):
    """What a ship carries of points (service/runners/ship_calls.py ShipBody.points)."""

    points: Points = []


def over_the_wire(points: list[tuple]) -> dict:
    """A columns batch as a worker sends it: built from rows, dumped, through JSON."""
    return json.loads(json.dumps(PointColumns.of(points).model_dump()))


def packed(fmt: str, *numbers) -> str:
    return base64.b64encode(struct.pack(f"<{len(numbers)}{fmt}", *numbers)).decode()


NOW = 1_765_000_000.123457
TRICKY = [(0, "loss", 1.0, NOW), (0, "lr", 1e-300, NOW), (0, "ünï ☃", -0.0, NOW), (1, "loss", 1.7976931348623157e308,
          NOW + 0.5), (1, "lr", 5e-324, NOW + 0.5), (2, "loss", 0.5, 0.0), (2, "x" * 64, 2.0, 2.0**35),
          (3, "loss", 0.25, NOW + 1e-6), (3, "loss", 0.125, NOW + 1e-6)]  # a step twice: the later wins


def test_columns_read_back_as_the_rows_they_were_built_from():
    body = Body.model_validate({"points": over_the_wire(TRICKY)})
    columns = body.points
    assert isinstance(columns, PointColumns) and len(columns) == len(TRICKY)
    assert [(s, columns.names[i], v, t) for s, i, v, t in zip(columns.steps, columns.name_index, columns.values,
                                                              columns.times, strict=True)] == TRICKY
    assert math.copysign(1, columns.values[2]) == -1  # -0.0 stays -0.0
    # About half the bytes of the rows form for a training run's values; the old form still read as rows (a batch
    # sent again as it was).
    run = [(s, name, math.sin(s + k) / (s + 1), NOW + s) for s in range(1000) for k, name in enumerate(("loss", "lr"))]
    assert len(json.dumps(over_the_wire(run))) < 0.6 * len(json.dumps([list(p) for p in run]))
    assert Body.model_validate({"points": [list(p) for p in TRICKY]}).points == TRICKY
    assert not Body.model_validate({"points": over_the_wire([])}).points


@pytest.mark.parametrize(("change", "where", "says"), [
    ({"steps": "AQ=="}, "points.columns.steps", "not a whole number of 4-byte numbers"),
    ({"steps": "***"}, "points.columns.steps", "not base64"),
    ({"steps": 7}, "points.columns.steps", "a base64 string is expected"),
    ({"steps": packed("i", 0, -5, 1)}, "points.columns.steps", "point 1 is -5"),
    ({"values": packed("d", 1.0, math.nan, 2.0)}, "points.columns.values", "must be finite: point 1 is nan"),
    ({"values": packed("d", 1e308, 1e308, -math.inf)}, "points.columns.values", "point 2 is -inf"),
    ({"times": packed("d", 1.0, -1.0, 2.0)}, "points.columns.times", "point 1 is -1.0"),
    ({"times": packed("d", 1.0, 2.0**36, 2.0)}, "points.columns.times", "point 1 is"),
    ({"name_index": packed("i", 0, 0, 2)}, "points.columns", "name_index points past names (2): point 2 is 2"),
    ({"values": packed("d", 1.0, 2.0)}, "points.columns", "values holds 2 points, steps 3"),
    ({"names": ["loss", ""]}, "points.columns.names.1", "at least 1 character"),
    ({"names": ["loss", "y" * 65]}, "points.columns.names.1", "at most 64 characters"),
    ({"values": "A" * (PACKED_MAX + 4)}, "points.columns.values", "more than 100,000 points"),
    ({"extra": []}, "points.columns.extra", "Extra inputs are not permitted"),
])
def test_a_bad_column_is_refused_naming_the_column_and_the_point(change, where, says):
    good = over_the_wire([(1, "loss", 1.0, NOW), (1, "lr", 0.1, NOW), (2, "loss", 0.5, NOW + 1)])
    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"points": good | change})
    errors = caught.value.errors()
    assert len(errors) == 1, errors
    assert ".".join(map(str, errors[0]["loc"])) == where and says in errors[0]["msg"], errors[0]


def test_either_form_is_bounded_to_points_max():
    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"points": [[1, "loss", 1.0, NOW]] * (POINTS_MAX + 1)})
    assert caught.value.errors()[0]["loc"] == ("points", "rows")
    many = array("d", [1.0]) * (POINTS_MAX + 1)
    wide = {"names": ["loss"], "steps": PointColumns.of([]).model_dump()["steps"], "name_index": "", "times": "",
            "values": base64.b64encode(many.tobytes()).decode()}
    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"points": wide})
    assert caught.value.errors()[0]["loc"] == ("points", "columns", "values")


def expected_blocks(series: list[dict]) -> list[tuple]:
    """Each (name, block)'s summary from the series as the API serves it (the latest attempt's value a step)."""
    out = []
    for entry in series:
        by_block: dict[int, list[tuple[int, float]]] = {}
        for step, value in zip(entry["steps"], entry["values"], strict=True):
            by_block.setdefault(step // blocks.BLOCK_STEPS, []).append((step, value))
        for block, points in sorted(by_block.items()):
            low, high = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
            out.append((entry["name"], block, len(points), points[-1][0], points[-1][1], low[0], low[1], high[0],
                        high[1]))
    return sorted(out)


def test_either_form_stores_the_rows_and_block_summaries_the_per_row_copy_stored(db_url):
    """Three jobs get the same batches: as rows, as columns (through JSON), and through insert_batch's per-row path
    (write_row on PostgreSQL, with the times datetime.fromtimestamp gives). The second batch resumes an earlier
    step (a retry's attempt 2), so a block is recomputed from its rows."""
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    first = TRICKY + [(s, name, math.sin(s * k), NOW + s) for s in range(4, 700) for k, name in
                      enumerate(("loss", "lr", "acc"), start=1)]
    again = [(s, name, math.cos(s), NOW + 1000 + s) for s in range(500, 800) for name in ("loss", "lr")]
    with sessions() as db:
        ids = [jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id for _ in range(3)]
        db.commit()
    rows_job, columns_job, before_job = ids
    for attempt, batch in ((1, first), (2, again)):
        with sessions() as db:
            stored = store_points(db, job_id=rows_job, attempt=attempt, node_rank=1, points=batch)
            stored += store_points(db, job_id=columns_job, attempt=attempt, node_rank=1,
                                   points=Body.model_validate({"points": over_the_wire(batch)}).points)
            metrics.insert_batch(db, job_id=before_job, attempt=attempt, node_rank=1,
                                 rows=metrics.shipped_rows(batch))
            assert stored == 2 * len(batch)
            db.commit()

    def stored_by(job_id: str) -> tuple[list, list, list]:
        with sessions() as db:
            points = db.execute(select(Metric.attempt, Metric.node_rank, Metric.step, Metric.name, Metric.value,
                                       Metric.time).where(Metric.job_id == job_id).order_by(Metric.id)).all()
            summaries = db.execute(select(MetricBlock.name, MetricBlock.block, MetricBlock.points,
                                          MetricBlock.last_step, MetricBlock.last_value, MetricBlock.min_step,
                                          MetricBlock.min_value, MetricBlock.max_step, MetricBlock.max_value)
                                   .where(MetricBlock.job_id == job_id).order_by(MetricBlock.name,
                                                                                 MetricBlock.block)).all()
            series = metrics.read_series(db, job_id=job_id, node_rank=1)
        return [tuple(p) for p in points], sorted(tuple(s) for s in summaries), series

    rows, columns, before = stored_by(rows_job), stored_by(columns_job), stored_by(before_job)
    assert rows == columns == before
    points, summaries, series = rows
    assert len(points) == len(first) + len(again)
    assert [p[:5] for p in points[:len(TRICKY)]] == [(1, 1, s, n, v) for s, n, v, _ in TRICKY]
    assert points[0][5].timestamp() == pytest.approx(NOW, abs=1e-6) and points[5][5].timestamp() == 0.0
    assert summaries == expected_blocks(series)  # exact for the series served, across the retry's steps
    loss = next(entry for entry in series if entry["name"] == "loss")
    assert loss["values"][loss["steps"].index(3)] == 0.125 and loss["values"][loss["steps"].index(600)] == \
        math.cos(600)
    engine.dispose()
