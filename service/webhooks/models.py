"""Webhooks and their outbox: one row per event per subscribed webhook, written with the state change it reports."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Webhook(Base):
    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # wh_<hex>
    owner: Mapped[str] = mapped_column(String(64), index=True)  # whose jobs' events it gets
    all_users: Mapped[bool] = mapped_column(Boolean, default=False)  # an admin's: every owner's jobs
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[str]] = mapped_column(JSON)
    format: Mapped[str] = mapped_column(String(8), default="json")  # json | slack
    # NOTE: kept as given: the API must sign with it (an HMAC key cannot be stored as a hash). Never shown back.
    secret: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Delivery(Base):
    """An event for one webhook (the outbox): pending until a 2xx (delivered) or past the give-up time (given_up).

    Ordered per (webhook, subject) by id: a row is sent only once every earlier row of its subject is settled.
    A delivery loop claims a row by setting claimed_by/claimed_until where it was unclaimed or its claim lapsed.
    """

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(32))  # X-Trainjobs-Event-Id: one event, every webhook's row
    event: Mapped[str] = mapped_column(String(32))  # job.succeeded, ...
    subject: Mapped[str] = mapped_column(String(64))  # job/<id> (sweep/<id> later): the order's key
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)  # the body's data, rendered when the event happened
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | given_up
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claimed_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    last_response: Mapped[str | None] = mapped_column(Text)  # the first bytes of the receiver's answer
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    tries: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))  # the latest few

    __table_args__ = (
        Index("ix_webhook_deliveries_status_due", "status", "next_attempt_at"),  # the loop's scan
        Index("ix_webhook_deliveries_order", "webhook_id", "subject", "id"),  # an earlier pending row?
        Index("ix_webhook_deliveries_webhook_id", "webhook_id", "id"),  # GET .../deliveries, newest first
    )
