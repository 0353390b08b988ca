"""The fair pool's tables: teams (weight, quota) and each owner's decayed usage."""

from datetime import datetime

from sqlalchemy import Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class Team(Base):
    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    max_slots: Mapped[int | None] = mapped_column(Integer)  # slots its running jobs may hold at once
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Usage(Base):
    """An owner's device-seconds of closed attempts, decayed to `as_of` (running ones are added when read)."""

    __tablename__ = "usage"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    as_of: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
