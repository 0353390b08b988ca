"""API tokens: 256 random bits shown once, stored as a SHA-256, found by hash, checked in constant time."""

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.exc import DatabaseError, IntegrityError
from sqlalchemy.orm import Session

from service.auth.models import ApiToken, User
from service.db import utcnow
from service.errors import InvalidRequest, TrainjobsError
from service.settings import Settings

log = logging.getLogger(__name__)

PREFIX = "tj_"  # recognisable in a leaked config file or a secret scanner
ADMIN_USER = "admin"
Role = Literal["admin", "user"]
ROLES = ("admin", "user")
TOUCH_EVERY = timedelta(seconds=60)  # last_used_at is written at most this often per token
TOUCH_WARN_EVERY_S = 300.0  # a full disk fails every touch: one warning per this, not one per request
_last_touch_warning = float("-inf")  # time.monotonic() of the last such warning


@dataclass(frozen=True)
class Principal:
    """Who is calling: a job's owner, their role, their rights."""

    user: str
    role: str
    token_id: str | None
    can_run_entrypoints: bool
    expires_at: datetime | None = None  # the token's: a cached principal is not used past it

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


class TokenNotFound(TrainjobsError):
    status_code = 404

    def __init__(self, token_id: str):
        super().__init__(f"token {token_id!r} not found", field="token_id")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create(db: Session, *, name: str, user: str, role: str = "user", expires_at: datetime | None = None,
           can_run_entrypoints: bool | None = None, team: str | None = None,
           multinode: bool | None = None) -> tuple[ApiToken, str]:
    """A new token for `user` (created if new); returns the row and the secret, which is never stored."""
    if role not in ROLES:
        raise InvalidRequest(f"role must be one of {', '.join(ROLES)}", field="role")
    if expires_at is not None and expires_at <= utcnow():
        raise InvalidRequest("expiry is in the past", field="expires_in_s")
    owner = db.get(User, user)
    if owner is None:
        try:
            with db.begin_nested():  # two tokens for a new user at once: one inserts the user, the other uses it
                owner = User(name=user, can_run_entrypoints=bool(can_run_entrypoints), created_at=utcnow())
                db.add(owner)
                db.flush()  # the token's foreign key needs the user's row first
        except IntegrityError:
            owner = db.get(User, user, populate_existing=True)
    if owner is None:
        raise RuntimeError(f"user {user!r} was neither inserted nor found")  # a bug, as a 500
    if can_run_entrypoints is not None:
        owner.can_run_entrypoints = can_run_entrypoints
    if team is not None:
        owner.team = team
    if multinode is not None:
        owner.multinode = multinode
    secret = PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(id=f"tok_{secrets.token_hex(8)}", user=user, name=name, role=role,
                   token_hash=hash_secret(secret), created_at=utcnow(), expires_at=expires_at)
    db.add(row)
    db.commit()
    return row, secret


def authenticate(db: Session, secret: str) -> Principal | None:
    """The principal of a live token, or None for an unknown, revoked or expired one."""
    if not secret.startswith(PREFIX) or len(secret) > 128:
        return None
    digest = hash_secret(secret)
    # One round trip: the token and its owner's right (a read's auth is this query; bench/auth.py).
    found = db.execute(select(ApiToken, User.can_run_entrypoints).outerjoin(User, User.name == ApiToken.user)
                       .where(ApiToken.token_hash == digest)).one_or_none()
    row, owner_may_run = found if found is not None else (None, None)
    # The lookup is by hash (no timing signal about the secret); compare again in constant time all the same.
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    now = utcnow()
    if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
        return None
    principal = Principal(user=row.user, role=row.role, token_id=row.id,
                          can_run_entrypoints=row.role == "admin" or bool(owner_may_run), expires_at=row.expires_at)
    if row.last_used_at is None or now - row.last_used_at > TOUCH_EVERY:
        touch(db, token_id=row.id, now=now)
    return principal


def touch(db: Session, *, token_id: str, now: datetime) -> None:
    """Write the token's last_used_at, best effort: a read never needs a write."""
    # NOTE: on a full disk or a read-only database every write fails while reads still work; a failed touch
    # must not turn every request into a 503, so it is rolled back and skipped (last_used_at is a hint).
    try:
        db.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=now))
        db.commit()
    except DatabaseError as exc:
        db.rollback()
        _warn_touch_failed(exc)


def _warn_touch_failed(exc: DatabaseError) -> None:
    global _last_touch_warning
    if time.monotonic() - _last_touch_warning < TOUCH_WARN_EVERY_S:
        return
    _last_touch_warning = time.monotonic()  # NOTE: racy across threads; at worst a second warning
    log.warning("could not record a token's last use (skipped; tokens still work): %s; a full disk or a "
                "read-only database? (this warning repeats at most every %.0f s)", exc.orig or exc,
                TOUCH_WARN_EVERY_S)


def visible(db: Session, principal: Principal) -> list[ApiToken]:
    query = select(ApiToken).order_by(ApiToken.created_at)
    if not principal.is_admin:
        query = query.where(ApiToken.user == principal.user)
    return list(db.scalars(query))


def revoke(db: Session, *, token_id: str, principal: Principal) -> ApiToken:
    """Admins revoke any token, users their own; someone else's is a 404 like an unknown one."""
    row = db.get(ApiToken, token_id)
    if row is None or not (principal.is_admin or row.user == principal.user):
        raise TokenNotFound(token_id)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        db.commit()
    return row


def has_live_admin(db: Session) -> bool:
    now = utcnow()
    return db.scalar(select(ApiToken.id).where(
        ApiToken.role == "admin", ApiToken.revoked_at.is_(None),
        (ApiToken.expires_at.is_(None)) | (ApiToken.expires_at > now)).limit(1)) is not None


def bootstrap_admin(db: Session, settings: Settings) -> str | None:
    """On a first start (no live admin token): create one, write it to the admin token file (0600), return it.

    A token file left from an older database whose token no longer works is replaced; one that an older
    version wrote into the data dir, where jobs can read it, is moved to the secrets dir.
    """
    path = settings.admin_token_file
    _move_legacy_token(settings.data_dir / path.name, path)
    if has_live_admin(db):
        if path.exists() and authenticate(db, path.read_text().strip()) is None:
            path.unlink()  # stale: from a database since reset
        return None
    _, secret = create(db, name="bootstrap", user=ADMIN_USER, role="admin")
    write_secret(path, secret)
    return secret


def write_secret(path: Path, text: str) -> None:
    """A file only this uid can read (0600), in a folder only this uid can enter (0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = path.parent.stat()
    if folder.st_mode & 0o077 and folder.st_uid == os.getuid():
        os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # also when the file existed with a wider mode
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def _move_legacy_token(old: Path, new: Path) -> None:
    if not (old.is_file() or old.is_symlink()):
        return
    if old.is_file() and not old.is_symlink() and not new.exists():
        write_secret(new, old.read_text().strip())
    old.unlink()
    log.warning("moved the admin token file out of the data dir (jobs could read it there) to %s; if users' "
                "entrypoint jobs ran, revoke that token and make a new one", new)
