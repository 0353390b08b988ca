"""What the API takes and returns for webhooks."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from service.lists import Listing
from service.webhooks.models import Delivery, Webhook
from service.webhooks.outbox import EVENTS

Event = Literal[EVENTS]  # type: ignore[valid-type]  # one list of names: outbox.EVENTS


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048, description="http(s); checked against TRAINJOBS_WEBHOOK_ALLOW")
    events: list[Event] = Field(default_factory=lambda: list(EVENTS), min_length=1, max_length=len(EVENTS),
                                description="default: every event")
    secret: Annotated[str | None, Field(min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$")] = Field(
        None, description="the HMAC key of X-Trainjobs-Signature; default: one made for you (shown once)")
    format: Literal["json", "slack"] = Field("json", description="slack: a Slack incoming-webhook body {text}")
    all_users: StrictBool = Field(False, description="admins only: every user's jobs, not only your own")

    @field_validator("events")
    @classmethod
    def _once_each(cls, events: list[str]) -> list[str]:
        return list(dict.fromkeys(events))


class WebhookPublic(BaseModel):
    id: str
    owner: str
    url: str
    events: list[str]
    format: str
    all_users: bool
    created_at: datetime
    secret_hint: str = Field(description="the secret's last 4 characters: which one it is, never the secret")

    @classmethod
    def of(cls, hook: Webhook) -> "WebhookPublic":
        return cls(id=hook.id, owner=hook.owner, url=hook.url, events=hook.events, format=hook.format,
                   all_users=hook.all_users, created_at=hook.created_at, secret_hint=f"...{hook.secret[-4:]}")


class WebhookCreated(WebhookPublic):
    secret: str = Field(description="shown this once: keep it to check each delivery's signature")


class WebhooksPublic(Listing):
    items: list[WebhookPublic]
    count: int


class DeliveryPublic(BaseModel):
    id: int
    event_id: str
    event: str
    subject: str
    status: Literal["pending", "delivered", "given_up"]
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None = Field(description="while pending: when the next try is due")
    last_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    last_response: str | None = Field(description="the first 500 characters of the receiver's last answer")
    delivered_at: datetime | None
    tries: list[dict[str, Any]] = Field(description="the latest 10 tries: at, status_code, error, duration_ms")

    @classmethod
    def of(cls, row: Delivery) -> "DeliveryPublic":
        return cls(id=row.id, event_id=row.event_id, event=row.event, subject=row.subject, status=row.status,
                   attempts=row.attempts, created_at=row.created_at,
                   next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
                   last_attempt_at=row.last_attempt_at, last_status_code=row.last_status_code,
                   last_error=row.last_error, last_response=row.last_response, delivered_at=row.delivered_at,
                   tries=row.tries or [])


class DeliveriesPublic(Listing):
    items: list[DeliveryPublic]
    count: int
