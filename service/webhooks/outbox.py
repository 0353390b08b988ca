"""The outbox: events written in the transaction of the change they report, then claimed, sent and settled.

emit() knows nothing of jobs: a job's event (service/jobs/notify.py) and, later, a sweep's pass it its
subject (`job/<id>`, `sweep/<id>`: the key events are ordered by), its owner and the data of the body.

Every move of a row is a compare-and-set, as a job's are: a delivery loop claims a due row only if it is
still pending and unclaimed (or its claim lapsed: the process that held it died), and settles it only while
it still holds the claim. So two API processes never send one row at once, and a crash leaves nothing stuck.
Order: a row is due only when no earlier row of its (webhook, subject) is pending, so event n+1 of a job is
never sent before event n is delivered or given up. NOTE: ids follow the order of a job's changes because each
change locks the job's row (the CAS's UPDATE, or hold's FOR UPDATE) before its event is inserted: event n+1
takes its id only after event n's transaction has committed, so no reader sees n+1 without n.
"""

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, ScalarSelect, delete, exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from service.db import utcnow
from service.webhooks.models import Delivery, Webhook

PENDING, DELIVERED, GIVEN_UP = "pending", "delivered", "given_up"
JOB_EVENTS = ("job.started", "job.succeeded", "job.failed", "job.cancelled", "job.hung", "job.preempted")
EVENTS = JOB_EVENTS  # sweep.finished joins them with sweeps
TEST_EVENT = "webhook.test"  # POST /v1/webhooks/{id}/test: tried once, never retried
TRIES_KEPT = 10  # per row, the latest: when, what status or error, how long
EXCERPT_CHARS = 500


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(12)}"


def emit(db: Session, *, event: str, subject: str, owner: str | ScalarSelect,
         data: Callable[[], dict[str, Any]]) -> int:
    """Put `event` in the outbox of every webhook of `owner` (and every all-users one) that asked for it.

    In the caller's transaction: the event is committed with the change it reports, or not at all. `owner` may
    be a scalar subquery (one round trip when no webhook listens); `data` is called only when one does, and
    gives the body's data beside `id`, `event` and `created_at` (a job's: {"job": <the job as GET shows it>}).
    Returns how many rows were written.
    """
    hooks = [h for h in db.scalars(select(Webhook).where(or_(Webhook.all_users.is_(True), Webhook.owner == owner)))
             if event in h.events]
    if not hooks:
        return 0
    now, event_id = utcnow(), new_event_id()
    payload = {"id": event_id, "event": event, "created_at": now.isoformat(), **data()}
    db.add_all(Delivery(webhook_id=h.id, event_id=event_id, event=event, subject=subject, payload=payload,
                        status=PENDING, attempts=0, created_at=now, next_attempt_at=now) for h in hooks)
    return len(hooks)


def due(db: Session, *, limit: int, now: datetime | None = None) -> list[int]:
    """Ids of rows to send now, oldest first: pending, due, unclaimed, and first of their (webhook, subject)."""
    now = now or utcnow()
    earlier = aliased(Delivery)
    blocked = exists().where(earlier.webhook_id == Delivery.webhook_id, earlier.subject == Delivery.subject,
                             earlier.status == PENDING, earlier.id < Delivery.id)
    return list(db.scalars(select(Delivery.id).where(Delivery.status == PENDING, Delivery.next_attempt_at <= now,
                                                     unclaimed(now), ~blocked)
                           .order_by(Delivery.id).limit(limit)))


def unclaimed(now: datetime) -> ColumnElement[bool]:
    return or_(Delivery.claimed_until.is_(None), Delivery.claimed_until < now)


@dataclass(frozen=True)
class Claimed:
    """What a claimed row's sender needs: the row and its webhook, read once the claim is held."""

    delivery: Delivery
    webhook: Webhook


def claim(db: Session, *, delivery_id: int, by: str, hold_s: float) -> Claimed | None:
    """Take the row for `hold_s` (past it, a claim lapses: its holder died). Commits. None: another took it."""
    now = utcnow()
    moved = db.execute(update(Delivery).where(Delivery.id == delivery_id, Delivery.status == PENDING, unclaimed(now))
                       .values(claimed_by=by, claimed_until=now + timedelta(seconds=hold_s))
                       .execution_options(synchronize_session=False)).rowcount
    db.commit()
    if moved != 1:
        return None
    row = db.get(Delivery, delivery_id, populate_existing=True)
    hook = db.get(Webhook, row.webhook_id) if row is not None else None
    return Claimed(row, hook) if hook is not None else None


@dataclass(frozen=True)
class Outcome:
    """One try: the receiver's status (None: no answer), its first bytes, or why nothing was sent."""

    status_code: int | None = None
    response: str | None = None
    error: str | None = None
    duration_ms: int = 0

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True)
class Backoff:
    first_s: float
    max_s: float
    give_up_s: float

    def wait_s(self, attempts: int) -> float:
        """After the attempts-th failure: first_s, doubled per failure, at most max_s."""
        return min(self.max_s, self.first_s * 2 ** min(attempts - 1, 60))


def settle(db: Session, *, claimed: Claimed, by: str, outcome: Outcome, backoff: Backoff) -> str | None:
    """Record the try, and deliver, schedule the next or give up; None if the claim was lost. Commits."""
    row, now = claimed.delivery, utcnow()
    attempts = row.attempts + 1
    tried = {"at": now.isoformat(), "status_code": outcome.status_code, "error": outcome.error,
             "duration_ms": outcome.duration_ms}
    values: dict[str, Any] = {"attempts": attempts, "last_attempt_at": now, "last_status_code": outcome.status_code,
                              "last_error": outcome.error, "last_response": outcome.response,
                              "tries": [*(row.tries or []), tried][-TRIES_KEPT:], "claimed_by": None,
                              "claimed_until": None}
    if outcome.ok:
        values.update(status=DELIVERED, delivered_at=now)
    elif row.event == TEST_EVENT or (now - row.created_at).total_seconds() >= backoff.give_up_s:
        values.update(status=GIVEN_UP)
    else:
        values.update(next_attempt_at=now + timedelta(seconds=backoff.wait_s(attempts)))
    moved = db.execute(update(Delivery).where(Delivery.id == row.id, Delivery.status == PENDING,
                                              Delivery.claimed_by == by)
                       .values(**values).execution_options(synchronize_session=False)).rowcount
    db.commit()
    return values.get("status", PENDING) if moved == 1 else None


def backlog(db: Session) -> tuple[int, datetime | None]:
    """Pending rows (an index range: settled rows are not read) and the oldest one's event time."""
    count, oldest = db.execute(select(func.count(), func.min(Delivery.created_at))
                               .where(Delivery.status == PENDING)).one()
    return count, oldest


def prune(db: Session, *, before: datetime, batch: int = 1000) -> int:
    """Delete one batch of delivered and given-up rows older than `before`. Commits; returns how many."""
    ids = list(db.scalars(select(Delivery.id).where(Delivery.status.in_([DELIVERED, GIVEN_UP]),
                                                    Delivery.created_at < before).limit(batch)))
    if ids:
        db.execute(delete(Delivery).where(Delivery.id.in_(ids)))
    db.commit()
    return len(ids)
