"""/v1/webhooks: a user's webhooks (an admin's may cover every user's jobs), their deliveries, a test."""

import secrets
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query

from service.auth.deps import PrincipalDep
from service.deps import INT64_MAX, SessionDep, SettingsDep
from service.errors import responses
from service.webhooks import allow, delivery, outbox, service
from service.webhooks.models import Delivery
from service.webhooks.schemas import (
    DeliveriesPublic,
    DeliveryPublic,
    WebhookCreate,
    WebhookCreated,
    WebhookPublic,
    WebhooksPublic,
)

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
WebhookId = Annotated[str, Path(max_length=64)]


@router.post("", status_code=201, response_model=WebhookCreated, responses=responses(400, 403, 413))
def create_webhook(body: WebhookCreate, db: SessionDep, settings: SettingsDep, principal: PrincipalDep):
    """A webhook for your jobs' events (an admin's with `all_users`: everyone's). A URL the address policy
    refuses (TRAINJOBS_WEBHOOK_ALLOW) is a 422 naming `url`. The answer shows the secret, this once."""
    hook = service.create(db, body=body, principal=principal, allow_list=settings.webhook_allow)
    return WebhookCreated(**WebhookPublic.of(hook).model_dump(), secret=hook.secret)


@router.get("", response_model=WebhooksPublic)
def list_webhooks(db: SessionDep, principal: PrincipalDep,
                  owner: Annotated[str | None, Query(max_length=64, description="admins only")] = None):
    hooks = service.visible(db, principal=principal, owner=owner)
    return WebhooksPublic(items=[WebhookPublic.of(h) for h in hooks], count=len(hooks))


@router.get("/{webhook_id}", response_model=WebhookPublic, responses=responses(404))
def read_webhook(webhook_id: WebhookId, db: SessionDep, principal: PrincipalDep):
    return WebhookPublic.of(service.get(db, webhook_id=webhook_id, principal=principal))


@router.delete("/{webhook_id}", response_model=WebhookPublic, responses=responses(404))
def delete_webhook(webhook_id: WebhookId, db: SessionDep, principal: PrincipalDep):
    """Deleted with its deliveries: events not yet delivered are dropped."""
    return WebhookPublic.of(service.remove(db, webhook_id=webhook_id, principal=principal))


@router.get("/{webhook_id}/deliveries", response_model=DeliveriesPublic, responses=responses(404))
def list_deliveries(
    webhook_id: WebhookId, db: SessionDep, principal: PrincipalDep,
    status: Literal["pending", "delivered", "given_up"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[int | None, Query(ge=1, le=INT64_MAX, description="an id: the page after it")] = None,
):
    """The webhook's deliveries, newest first: each event's tries, status codes, answers, next try."""
    rows = service.deliveries(db, webhook_id=webhook_id, principal=principal, status=status, limit=limit,
                              before=before)
    return DeliveriesPublic(items=[DeliveryPublic.of(r) for r in rows], count=len(rows))


@router.post("/{webhook_id}/test", response_model=DeliveryPublic, responses=responses(404))
def test_webhook(webhook_id: WebhookId, db: SessionDep, settings: SettingsDep, principal: PrincipalDep):
    """Send a `webhook.test` event now, once (no retries), signed as every event; answers its delivery:
    `delivered`, or `given_up` with the receiver's status or the error. Waits at most TRAINJOBS_WEBHOOK_TIMEOUT_S."""
    hook = service.get(db, webhook_id=webhook_id, principal=principal)
    by = f"test:{secrets.token_hex(8)}"
    claimed = service.add_test(db, hook=hook, by=by, hold_s=settings.webhook_timeout_s + delivery.CLAIM_MARGIN_S)
    with delivery.make_client(settings) as client:
        outcome = delivery.send(client, hook, claimed.delivery.payload,
                                allow.policy_of(settings.webhook_allow))
    outbox.settle(db, claimed=claimed, by=by, outcome=outcome, backoff=delivery.backoff_of(settings))
    db.expire_all()
    return DeliveryPublic.of(db.get(Delivery, claimed.delivery.id))
