"""Write metric batches, read them back as series."""

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from service.metrics.models import Metric


def insert_batch(
    db: Session, *, job_id: str, attempt: int, rows: Iterable[tuple[int, str, float, datetime]]
) -> int:
    """Insert (step, name, value, time) rows in one statement."""
    values = [
        {"job_id": job_id, "attempt": attempt, "step": step, "name": name, "value": value, "time": t}
        for step, name, value, t in rows
    ]
    if values:
        db.execute(insert(Metric), values)
    return len(values)


def read_series(
    db: Session, *, job_id: str, name: str | None = None, after_step: int | None = None
) -> list[dict]:
    query = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id)
    if name is not None:
        query = query.where(Metric.name == name)
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
