"""The machines that join the pool: join tokens an admin makes, and each machine's own credential (issue 42)."""

from datetime import datetime

from sqlalchemy import Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db import Base, UTCDateTime, utcnow


class JoinToken(Base):
    """What an admin gives a new machine to join the pool (issue 42): exchanged for a worker credential at its
    first start, as a CI runner's registration token is. Stored as a hash; `uses_left` None: any number."""

    __tablename__ = "worker_join_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public: listed, used to revoke
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    uses_left: Mapped[int | None] = mapped_column(Integer)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Credential(Base):
    """A joined machine's own credential: what its worker sends to /v1/worker/*, never a user's token, never the
    database's. `runner` names the machine; every worker row its processes register (and their lanes) carry it,
    which is how the API tells that a worker acts only on what is its own."""

    __tablename__ = "worker_credentials"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    runner: Mapped[str] = mapped_column(String(128), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    join_token: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
