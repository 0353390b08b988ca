"""Webhooks on the database: make, read (the owner's, or any for an admin), delete, their deliveries, a test."""

import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.auth.tokens import Principal
from service.db import utcnow
from service.errors import Forbidden, NotFound
from service.lists import newest_first, page_of
from service.webhooks import allow, outbox
from service.webhooks.models import Delivery, Webhook
from service.webhooks.schemas import WebhookCreate


class WebhookNotFound(NotFound):
    def __init__(self, webhook_id: str):
        super().__init__(f"webhook {webhook_id!r} not found", field="webhook_id")


def create(db: Session, *, body: WebhookCreate, principal: Principal, allow_list: str) -> Webhook:
    """Check the URL against the policy (a 422 naming url) and store the webhook. Commits."""
    if body.all_users and not principal.is_admin:
        raise Forbidden("all_users needs an admin token: a user's webhooks get their own jobs' events",
                        field="all_users")
    allow.check(body.url, allow_list)
    hook = Webhook(id=f"wh_{secrets.token_hex(8)}", owner=principal.user, all_users=body.all_users, url=body.url,
                   events=body.events, format=body.format, secret=body.secret or f"whsec_{secrets.token_urlsafe(32)}",
                   created_at=utcnow())
    db.add(hook)
    db.commit()
    return hook


def visible(db: Session, *, principal: Principal, owner: str | None = None) -> list[Webhook]:
    """The caller's webhooks, oldest first; an admin may name another `owner` (a user's `owner` is ignored)."""
    owner = owner if principal.is_admin and owner else principal.user
    return list(db.scalars(select(Webhook).where(Webhook.owner == owner).order_by(Webhook.created_at, Webhook.id)))


def get(db: Session, *, webhook_id: str, principal: Principal) -> Webhook:
    """The webhook if the caller may see it (its owner, an admin); anyone else's is a 404, as if it did not exist."""
    hook = db.get(Webhook, webhook_id) if len(webhook_id) <= 32 else None
    if hook is None or not (principal.is_admin or hook.owner == principal.user):
        raise WebhookNotFound(webhook_id)
    return hook


def remove(db: Session, *, webhook_id: str, principal: Principal) -> Webhook:
    """Delete the webhook and its outbox rows (pending ones are dropped, not sent). Commits."""
    hook = get(db, webhook_id=webhook_id, principal=principal)
    db.execute(delete(Delivery).where(Delivery.webhook_id == hook.id))  # explicit: no reliance on SQLite's pragma
    db.delete(hook)
    db.commit()
    return hook


def deliveries(db: Session, *, webhook_id: str, principal: Principal, status: str | None = None,
               limit: int = 50, before: int | None = None) -> list[Delivery]:
    """The webhook's outbox rows, newest first (`before`: an id, for the next page)."""
    hook = get(db, webhook_id=webhook_id, principal=principal)
    query = newest_first(select(Delivery).where(Delivery.webhook_id == hook.id), Delivery.id, cursor=before,
                         limit=limit)
    if status is not None:
        query = query.where(Delivery.status == status)
    return page_of(db.scalars(query).all(), limit=limit)[0]


def add_test(db: Session, *, hook: Webhook, by: str, hold_s: float) -> outbox.Claimed:
    """A webhook.test row for this webhook alone (a subject of its own: it waits behind nothing), already
    claimed by the request that sends it: the loop leaves it, unless that request dies. Commits."""
    now, event_id = utcnow(), outbox.new_event_id()
    payload = {"id": event_id, "event": outbox.TEST_EVENT, "created_at": now.isoformat(),
               "webhook": {"id": hook.id, "url": hook.url, "events": hook.events}}
    row = Delivery(webhook_id=hook.id, event_id=event_id, event=outbox.TEST_EVENT, subject=f"test/{event_id}",
                   payload=payload, status=outbox.PENDING, attempts=0, created_at=now, next_attempt_at=now,
                   claimed_by=by, claimed_until=now + timedelta(seconds=hold_s))
    db.add(row)
    db.commit()
    return outbox.Claimed(row, hook)
