"""Who may call the API: users (owners of jobs) and their bearer tokens, stored only as hashes."""

from datetime import datetime

from sqlalchemy import Boolean, Float, ForeignKey, Integer, String, false
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class User(Base):
    __tablename__ = "users"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)  # a job's owner
    can_run_entrypoints: Mapped[bool] = mapped_column(Boolean, default=False)  # a user's own script
    # A multi-node gang (nnodes > 1), whose ranks share their hosts' network: an admin grants it (issue 41).
    multinode: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The fair pool (service/scheduling): a team shares first, then its users; a quota bounds slots held at once.
    team: Mapped[str | None] = mapped_column(String(64), index=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    max_slots: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: shown by `token list`, used to revoke
    user: Mapped[str] = mapped_column(ForeignKey("users.name", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(8))  # admin | user
    # sha256 of the secret: the secret is 256 random bits, so a fast hash is enough (no password stretching).
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
