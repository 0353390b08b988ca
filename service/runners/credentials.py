"""A machine joins the pool with a credential of its own (issue 42): join tokens, worker credentials, revocation.

As a CI runner registers: an admin makes a join token (`tjj_…`), the machine's worker exchanges it once for a
worker credential (`tjw_…`) naming its runner, and sends that from then on. Both are 256 random bits shown once
and stored as a SHA-256 (as API tokens are, service/auth/tokens.py). A worker credential is no user's token: it
authenticates only under /v1/worker/ (a user's routes find no such token), and a user's token is refused there.
"""

import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from service.auth.tokens import hash_secret
from service.db import utcnow
from service.errors import InvalidRequest, TrainjobsError
from service.runners.models import Credential, JoinToken
from service.workers.models import Worker

JOIN_PREFIX, CREDENTIAL_PREFIX = "tjj_", "tjw_"
RUNNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a host name, or what --name says


class JoinTokenNotFound(TrainjobsError):
    status_code = 404

    def __init__(self, token_id: str):
        super().__init__(f"join token {token_id!r} not found", field="token_id")


@dataclass(frozen=True)
class Runner:
    """Who is calling /v1/worker/: a joined machine, by its credential."""

    name: str
    credential_id: str

    def owns(self, worker_id: str) -> bool:
        """Its worker processes are named after it: `runner`, `runner-<pid>`, and their lanes `…​.<i>`."""
        return worker_id == self.name or worker_id.startswith((f"{self.name}-", f"{self.name}."))


def create_join_token(db: Session, *, created_by: str, expires_at: datetime | None = None,
                      uses: int | None = None) -> tuple[JoinToken, str]:
    """A new join token; returns the row and the secret, which is never stored. The caller commits."""
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidRequest("expiry is in the past", field="expires_in_s")
    secret = JOIN_PREFIX + secrets.token_urlsafe(32)
    row = JoinToken(id=f"wjt_{secrets.token_hex(8)}", token_hash=hash_secret(secret), created_by=created_by,
                    created_at=utcnow(), expires_at=expires_at, uses_left=uses)
    db.add(row)
    return row, secret


def ensure_join_token(db: Session, *, secret: str, created_by: str) -> JoinToken | None:
    """A join token whose secret the operator chose (TRAINJOBS_JOIN_TOKEN_FILE: how a compose file's workers join,
    as k3s's server token), stored as a hash once: no expiry, any number of uses. One an admin revoked stays
    revoked. None when `secret` is no join token. The caller commits."""
    secret = secret.strip()
    if not secret.startswith(JOIN_PREFIX) or not 36 <= len(secret) <= 128:
        return None
    digest = hash_secret(secret)
    row = db.scalar(select(JoinToken).where(JoinToken.token_hash == digest))
    if row is None:
        row = JoinToken(id=f"wjt_{digest[:16]}", token_hash=digest, created_by=created_by, created_at=utcnow())
        db.add(row)
    return row


def join_tokens(db: Session) -> list[JoinToken]:
    return list(db.scalars(select(JoinToken).order_by(JoinToken.created_at)))


def revoke_join_token(db: Session, *, token_id: str) -> JoinToken:
    row = db.get(JoinToken, token_id)
    if row is None:
        raise JoinTokenNotFound(token_id)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def join(db: Session, *, secret: str, runner: str) -> tuple[Credential, str] | None:
    """The join token's exchange for a credential naming `runner`; None for an unknown, spent, expired or revoked
    token. The runner's earlier credentials are revoked: one machine, one live credential. The caller commits."""
    if not RUNNER.match(runner):
        raise InvalidRequest("runner must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or a "
                             "digit", field="runner")
    if not secret.startswith(JOIN_PREFIX) or len(secret) > 128:
        return None
    digest, now = hash_secret(secret), utcnow()
    token = db.scalar(select(JoinToken).where(JoinToken.token_hash == digest))
    if token is None or not hmac.compare_digest(token.token_hash, digest):
        return None
    # One use spent as a compare-and-set: two machines joining on the last use, one wins.
    spent = db.execute(update(JoinToken).where(
        JoinToken.id == token.id, JoinToken.revoked_at.is_(None),
        or_(JoinToken.expires_at.is_(None), JoinToken.expires_at > now),
        or_(JoinToken.uses_left.is_(None), JoinToken.uses_left > 0),
    ).values(uses_left=JoinToken.uses_left - 1).execution_options(synchronize_session=False))
    if spent.rowcount != 1:
        return None
    db.execute(update(Credential).where(Credential.runner == runner, Credential.revoked_at.is_(None))
               .values(revoked_at=now))
    credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    row = Credential(id=f"wcr_{secrets.token_hex(8)}", runner=runner, token_hash=hash_secret(credential),
                     join_token=token.id, created_at=now)
    db.add(row)
    return row, credential


def authenticate(db: Session, secret: str) -> Runner | None:
    """The runner of a live worker credential, or None."""
    if not secret.startswith(CREDENTIAL_PREFIX) or len(secret) > 128:
        return None
    digest = hash_secret(secret)
    row = db.scalar(select(Credential).where(Credential.token_hash == digest))
    if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
        return None
    return Runner(name=row.runner, credential_id=row.id)


def revoke_runner(db: Session, *, runner: str) -> int:
    """Every live credential of `runner` revoked: its worker's next call gets a 401, and it hands its jobs back
    and stops. How many were live. The caller commits."""
    db.execute(update(Worker).where(Worker.runner == runner).values(state="draining"))  # placed on no more
    return db.execute(update(Credential).where(Credential.runner == runner, Credential.revoked_at.is_(None))
                      .values(revoked_at=utcnow())).rowcount


def runner_of(db: Session, *, worker_id: str) -> str | None:
    """The runner a worker row belongs to (None: a worker that writes the database itself, or no such row)."""
    return db.scalar(select(Worker.runner).where(Worker.id == worker_id))
