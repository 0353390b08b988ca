"""The caller of every /v1 route: a bearer token's principal, and the jobs that principal may see."""

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Row, select
from sqlalchemy.orm import Session, sessionmaker

from service.auth.tokens import ADMIN_USER, Principal, authenticate, hash_secret
from service.errors import Forbidden, JobNotFound, TrainjobsError
from service.jobs.models import Job
from service.settings import is_loopback

# With TRAINJOBS_AUTH=off (one user on one machine, loopback only) everyone is this principal.
LOCAL_ADMIN = Principal(user=ADMIN_USER, role="admin", token_id=None, can_run_entrypoints=True)


class Unauthorized(TrainjobsError):
    status_code = 401
    headers = {"WWW-Authenticate": "Bearer"}

    def __init__(self, message: str):
        super().__init__(message, field="Authorization")


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `[::1]:8000` → `::1`, `localhost:8000` → `localhost`."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


def check_loopback_host(request: Request) -> None:
    """With auth off, refuse a request not addressed to a loopback name: a web page that re-binds its own DNS
    name to 127.0.0.1 (DNS rebinding) reaches this port from the user's browser, but with its own name as Host."""
    header = request.headers.get("host", "")
    if not is_loopback(host_name(header).lower()):
        raise Forbidden(f"auth is off, which serves loopback only: Host {header!r} is not localhost, 127.0.0.1 "
                        "or [::1]", field="Host")


async def current_principal(request: Request) -> Principal:
    """The caller. A token seen lately is answered from the process's cache (service/auth/cache.py), with no
    thread and no database; the rest is authenticated in the threadpool, in a short session of its own."""
    settings = request.app.state.settings
    if not settings.auth:
        server = request.scope.get("server")
        if server and not is_loopback(server[0]):  # the CLI refuses to bind elsewhere; this is the backstop
            raise Unauthorized("auth is off, which serves loopback only")
        check_loopback_host(request)
        return LOCAL_ADMIN
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("missing bearer token: send Authorization: Bearer <token>")
    cache = request.app.state.principals
    if cache.due():
        await cache.refresh_once()
    digest = hash_secret(secret)
    principal, generation = cache.get(digest)
    if principal is None:
        principal = await cache.authenticate_once(
            digest, generation, lambda: authenticate_in_session(request.app.state.sessionmaker, secret))
        if principal is None:
            raise Unauthorized("invalid, revoked or expired token")
        cache.put(digest, principal, principal.expires_at, generation)
    return principal


def authenticate_in_session(factory: sessionmaker[Session], secret: str) -> Principal | None:
    with factory() as db:
        return authenticate(db, secret)


PrincipalDep = Annotated[Principal, Depends(current_principal)]


async def admin_only(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this needs an admin token", field="Authorization")
    return principal


AdminDep = Annotated[Principal, Depends(admin_only)]


def visible_job(db: Session, *, job_id: str, principal: Principal) -> Row:
    """The job's (owner, status, version) if the caller may see it, in one indexed read; someone else's job is
    a 404, as if it did not exist. The version is the ETag of its read (service/jobs/etag.py)."""
    row = (db.execute(select(Job.owner, Job.status, Job.version).where(Job.id == job_id)).first()
           if len(job_id) <= 64 else None)
    if row is None or not (principal.is_admin or row.owner == principal.user):
        raise JobNotFound(job_id)
    return row


def owned_job_id(job_id: str, principal: PrincipalDep, request: Request) -> str:
    """The path's job id if the caller may see that job; someone else's job is a 404, as if it did not exist."""
    with request.app.state.sessionmaker() as db:  # short: an SSE stream must not hold a transaction open
        visible_job(db, job_id=job_id, principal=principal)
    return job_id


JobIdDep = Annotated[str, Depends(owned_job_id)]
