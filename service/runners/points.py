"""Metric points as a batch carries them (issue 42): rows, or packed columns, and their way to the database.

A flooding job's batch is 5,000-100,000 points. As rows (`[[step, name, value, unix time], ...]`) the API spent
~10 µs of its CPU a point before the database saw it (bench/README.md "Metric ingest through the worker API"):
most of it walking the parsed JSON (the strict-JSON check looks at every number, service/api/strict_json.py),
then decoding it and validating it. As columns, each numeric column is one base64 string of little-endian
fixed-width numbers: the JSON holds five strings whatever the number of points, and reading it is base64 and
`array` at C speed, with every bound checked on the arrays (min, max, a sum for finiteness), never per point in
Python. Its body is half the size of the rows'.

    {"names": ["loss", "lr"],            the batch's series, each once
     "steps":      base64(int32 LE),     point i's step
     "name_index": base64(int32 LE),     point i's name: names[name_index[i]]
     "values":     base64(float64 LE),   finite
     "times":      base64(float64 LE)}   unix seconds, 0 <= t <= 2^35

Both forms are taken (`Points`), so a batch built by an older worker, or sent again as it was, still applies. A
bad column is a 422 naming it (`points.columns.values`) and, where it can, the point (`point 17 is not finite`).
"""

import base64
import binascii
import math
import sys
from array import array
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainSerializer,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy.orm import Session

from service.metrics import service as metrics
from trainjobs.runenv import METRIC_NAME_MAX, STEP_MAX

POINTS_MAX = 100_000  # metric points a batch carries (the worker's per-ship bound, TRAINJOBS_METRIC_MAX_POINTS_PER_S)
TIME_MAX = 2**35
# Each column's code for `array` and its width in bytes on the wire; NOTE: 'i' is a C int, 4 bytes wherever we run.
WIDTHS = {"steps": ("i", 4), "name_index": ("i", 4), "values": ("d", 8), "times": ("d", 8)}
PACKED_MAX = (POINTS_MAX * 8 + 2) // 3 * 4  # base64 characters of the widest column at POINTS_MAX points

Name = Annotated[str, Field(min_length=1, max_length=METRIC_NAME_MAX)]
Step = Annotated[int, Field(ge=0, lt=STEP_MAX)]
Value = Annotated[float, Field(allow_inf_nan=False)]
UnixTime = Annotated[float, Field(ge=0, le=TIME_MAX)]
Point = tuple[Step, Name, Value, UnixTime]  # (step, name, value, unix time): one metric point, as a row


def pack(numbers: array) -> str:
    """An array as a column carries it: base64 of its little-endian bytes."""
    if sys.byteorder == "big":
        numbers = array(numbers.typecode, numbers)
        numbers.byteswap()
    return base64.b64encode(numbers.tobytes()).decode("ascii")


def unpack(text: str, typecode: str, width: int) -> array:
    """A column's numbers (ValueError naming what is wrong with its text)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 ({exc})") from None
    if len(raw) % width:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {width}-byte numbers")
    numbers = array(typecode)
    assert numbers.itemsize == width, f"array {typecode!r} is {numbers.itemsize} bytes here"
    numbers.frombytes(raw)
    if sys.byteorder == "big":
        numbers.byteswap()
    return numbers


def _first(numbers: array, bad) -> str:
    """Which point is at fault, for the 422 (only once a bound failed: a Python loop is fine here)."""
    return next((f"point {i} is {x!r}" for i, x in enumerate(numbers) if bad(x)), "")


Packed = Annotated[array, PlainSerializer(pack, return_type=str)]


class PointColumns(BaseModel):
    """Metric points by column: point i is (steps[i], names[name_index[i]], values[i], times[i]). Each numeric
    column is base64 of little-endian numbers: steps and name_index int32, values and times float64."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    names: list[Name] = Field(max_length=POINTS_MAX, description="the batch's series, each once")
    steps: Packed = Field(json_schema_extra={"type": "string", "maxLength": PACKED_MAX})
    name_index: Packed = Field(json_schema_extra={"type": "string", "maxLength": PACKED_MAX})
    values: Packed = Field(json_schema_extra={"type": "string", "maxLength": PACKED_MAX})
    times: Packed = Field(json_schema_extra={"type": "string", "maxLength": PACKED_MAX})

    @field_validator("steps", "name_index", "values", "times", mode="plain")
    @classmethod
    def _column(cls, value: Any, info: ValidationInfo) -> array:
        typecode, width = WIDTHS[info.field_name]
        if isinstance(value, array):  # built in-process (a database worker's call, a test)
            if value.typecode != typecode:
                raise ValueError(f"an array of {typecode!r} is expected, not {value.typecode!r}")
            numbers = value
        elif isinstance(value, str):
            if len(value) > PACKED_MAX:
                raise ValueError(f"{len(value):,} characters: more than {POINTS_MAX:,} points")
            numbers = unpack(value, typecode, width)
        else:
            raise ValueError("a base64 string is expected")
        if not numbers:
            return numbers
        if info.field_name in ("steps", "name_index") and min(numbers) < 0:
            raise ValueError(f"must be >= 0: {_first(numbers, lambda x: x < 0)}")
        if info.field_name == "values" and not math.isfinite(sum(numbers, 0.0)):
            # A sum of finite values may overflow: only then is each one looked at.
            if bad := _first(numbers, lambda x: not math.isfinite(x)):
                raise ValueError(f"must be finite: {bad}")
        if info.field_name == "times" and not 0 <= min(numbers) <= max(numbers) <= TIME_MAX:
            raise ValueError(f"must be unix seconds within [0, 2^35]: "
                             f"{_first(numbers, lambda x: not 0 <= x <= TIME_MAX)}")
        return numbers

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        count = len(self.steps)
        for field in ("name_index", "values", "times"):
            if len(getattr(self, field)) != count:
                raise ValueError(f"{field} holds {len(getattr(self, field)):,} points, steps {count:,}: every "
                                 "column holds one number a point")
        if count and max(self.name_index) >= len(self.names):
            bad = _first(self.name_index, lambda x: x >= len(self.names))
            raise ValueError(f"name_index points past names ({len(self.names)}): {bad}")
        return self

    def __len__(self) -> int:
        return len(self.steps)

    @classmethod
    def of(cls, rows: list[tuple[int, str, float, float]]) -> "PointColumns":
        """Rows (step, name, value, unix time) as columns (the worker's MetricTail builds its batch this way)."""
        index: dict[str, int] = {}
        for name in dict.fromkeys(name for _, name, _, _ in rows):
            index[name] = len(index)
        steps, names, values, times = zip(*rows, strict=True) if rows else ((), (), (), ())
        return cls.model_construct(names=list(index), steps=array("i", steps),
                                   name_index=array("i", map(index.__getitem__, names)),
                                   values=array("d", values), times=array("d", times))


def _form(value: Any) -> str:
    return "rows" if isinstance(value, list | tuple) else "columns"


Points = Annotated[Annotated[list[Point], Field(max_length=POINTS_MAX), Tag("rows")]
                   | Annotated[PointColumns, Tag("columns")], Discriminator(_form)]


def store_points(db: Session, *, job_id: str, attempt: int, node_rank: int, points: list | PointColumns) -> int:
    """A batch's points into the metrics table (by one binary COPY on PostgreSQL) and their block summaries, in the
    session's transaction; either form."""
    if isinstance(points, PointColumns):
        return metrics.insert_points(db, job_id=job_id, attempt=attempt, node_rank=node_rank, steps=points.steps,
                                     names=points.names, name_index=points.name_index, values=points.values,
                                     times=points.times)
    return metrics.insert_shipped(db, job_id=job_id, attempt=attempt, node_rank=node_rank, points=points)
