"""The worker protocol's first routes (issue 42, docs/architecture.md "The worker protocol"): a machine joins with
a join token, and its worker registers and beats with a credential of its own instead of the database's.

/v1/worker/*: a worker credential only (`tjw_…`); /v1/worker-tokens and /v1/runners: an admin's token.
"""

import time
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from service.auth.deps import PrincipalDep, Unauthorized
from service.auth.tokens import hash_secret
from service.db import utcnow
from service.deps import RedisDep, SessionDep, SettingsDep
from service.errors import Forbidden, NotFound
from service.jobs import lifecycle
from service.runners import calls, credentials, protocol  # noqa: F401 (calls: every call registers)
from service.runners.credentials import Runner
from service.runners.models import Credential, JoinToken
from service.runners.tick_calls import WORKER_ID, BeatBody, BeatPublic, own_registered
from service.workers import service as workers

CACHE_S = 2.0  # a credential seen within this long is not looked up again; a revocation reaches every API in it


class Inventory(BaseModel):
    """What a worker process offers (worker/inventory.py Offer), as it registers."""

    worker_id: str = Field(pattern=WORKER_ID)
    host: str = Field(max_length=256)
    address: str = Field(max_length=256)
    device: Literal["cpu", "cuda"]
    slots: int = Field(ge=1, le=4096)
    memory_bytes: int | None = Field(None, ge=0)
    host_memory_bytes: int | None = Field(None, ge=0)
    labels: dict[str, str] = Field(default_factory=dict, max_length=256)
    max_jobs: int = Field(1, ge=1, le=4096)
    devices: list[dict[str, Any]] | None = Field(None, max_length=4096)


class JoinBody(BaseModel):
    runner: str = Field(pattern=credentials.RUNNER.pattern, description="the machine's name (its host name)")


class JoinPublic(BaseModel):
    runner: str
    credential_id: str
    credential: str = Field(description="shown once: the worker keeps it and sends it as its bearer token")
    lease_s: float
    heartbeat_s: float


class JoinTokenCreate(BaseModel):
    expires_in_s: int | None = Field(None, ge=60, le=366 * 86400)
    uses: int | None = Field(None, ge=1, le=100_000, description="how many machines may join with it; none: any")


class JoinTokenPublic(BaseModel):
    id: str
    created_by: str
    created_at: datetime
    expires_at: datetime | None = None
    uses_left: int | None = None
    revoked_at: datetime | None = None
    token: str | None = Field(None, description="shown once, at creation")

    @classmethod
    def of(cls, row: JoinToken, token: str | None = None) -> "JoinTokenPublic":
        return cls(id=row.id, created_by=row.created_by, created_at=row.created_at, expires_at=row.expires_at,
                   uses_left=row.uses_left, revoked_at=row.revoked_at, token=token)


class RunnerPublic(BaseModel):
    runner: str
    credential_id: str
    created_at: datetime
    revoked_at: datetime | None = None

    @classmethod
    def of(cls, row: Credential) -> "RunnerPublic":
        return cls(runner=row.runner, credential_id=row.id, created_at=row.created_at, revoked_at=row.revoked_at)


async def current_runner(request: Request) -> Runner:
    """The joined machine calling: a live worker credential (a user's token is no worker's)."""
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret.startswith(credentials.CREDENTIAL_PREFIX):
        raise Unauthorized("a worker route: send the worker's credential (Authorization: Bearer tjw_...), which "
                           "`trainjobs worker --api URL --join-token T` gets once for a join token")
    cache: dict[str, tuple[Runner, float]] = request.app.state.runners
    digest, now = hash_secret(secret), time.monotonic()
    hit = cache.get(digest)
    if hit is not None and hit[1] > now:
        return hit[0]
    runner = await run_in_threadpool(_authenticate, request.app.state.sessionmaker, secret)
    if runner is None:
        cache.pop(digest, None)
        raise Unauthorized("invalid or revoked worker credential: this machine must join again")
    if len(cache) > 10_000:
        cache.clear()
    cache[digest] = (runner, now + CACHE_S)
    return runner


def _authenticate(factory: sessionmaker[Session], secret: str) -> Runner | None:
    with factory() as db:
        return credentials.authenticate(db, secret)


RunnerDep = Annotated[Runner, Depends(current_runner)]


def join_secret(request: Request) -> str:
    """The join token a machine sends as its bearer (checked before the body: no token, no answer about it)."""
    secret = request.headers.get("Authorization", "").partition(" ")[2].strip()
    if not secret.startswith(credentials.JOIN_PREFIX):
        raise Unauthorized("send an admin's join token (Authorization: Bearer tjj_...): trainjobs worker-token create")
    return secret


router = APIRouter(prefix="/v1/worker", tags=["worker protocol"])


def _serve(found: protocol.Call):
    """`POST /v1/worker/<name>` for one of the protocol's calls: the caller's credential, the body checked by its
    model, the handler in the threadpool (it does blocking I/O), its answer as JSON (or 204)."""
    def endpoint(body: found.body, runner: RunnerDep, db: SessionDep, settings: SettingsDep,  # type: ignore[name-defined]
                 redis: RedisDep):
        with db:
            answer = found.handler(db, protocol.Context(runner, settings, redis), body)
        return Response(status_code=204) if found.answer is None else answer

    endpoint.__name__ = f"worker_{found.name.replace('/', '_').replace('-', '_')}"
    endpoint.__doc__ = found.summary
    router.add_api_route(f"/{found.name}", endpoint, methods=["POST"], response_model=found.answer,
                         status_code=204 if found.answer is None else 200, summary=found.summary.split("\n")[0])


@router.post("/join", response_model=JoinPublic, status_code=201)
def join(secret: Annotated[str, Depends(join_secret)], body: JoinBody, db: SessionDep,
         settings: SettingsDep) -> JoinPublic:
    """A join token (as the bearer) for this machine's worker credential, shown once. The runner's earlier
    credential is revoked: one live credential per machine."""
    with db:
        found = credentials.join(db, secret=secret, runner=body.runner)
        if found is None:
            raise Unauthorized("invalid, spent, expired or revoked join token (an admin makes one: trainjobs "
                               "worker-token create)")
        row, credential = found
        db.commit()
    return JoinPublic(runner=row.runner, credential_id=row.id, credential=credential, lease_s=settings.lease_s,
                      heartbeat_s=settings.heartbeat_s)


@router.post("/register", status_code=204)
def register(body: Inventory, runner: RunnerDep, db: SessionDep) -> Response:
    """This worker process's row, made or refreshed (as workers.register does for a database worker)."""
    with db:
        own_registered(db, runner, body.worker_id)
        workers.register(db, runner=runner.name, **body.model_dump())
        db.commit()
    return Response(status_code=204)


@router.post("/heartbeat", response_model=BeatPublic)
def heartbeat(body: BeatBody, runner: RunnerDep, db: SessionDep) -> BeatPublic:
    """Liveness (the API's clock), draining, pressure, and its devices when their health changed."""
    with db:
        own_registered(db, runner, body.worker_id)
        found = workers.beat(db, worker_id=body.worker_id, draining=body.draining, pressure=body.pressure,
                             devices=body.devices, images=body.images)
        db.commit()
    return BeatPublic(registered=found)


@router.delete("/workers/{worker_id}", status_code=204)
def deregister(worker_id: str, runner: RunnerDep, db: SessionDep) -> Response:
    """A worker that stops cleanly leaves the list at once."""
    with db:
        own_registered(db, runner, worker_id)
        workers.remove(db, worker_id=worker_id)
        db.commit()
    return Response(status_code=204)


for _call in protocol.CALLS.values():
    _serve(_call)

admin_router = APIRouter(tags=["workers"])


@admin_router.post("/v1/worker-tokens", response_model=JoinTokenPublic, status_code=201)
def create_join_token(body: JoinTokenCreate, principal: PrincipalDep, db: SessionDep) -> JoinTokenPublic:
    """A join token for new machines (its secret shown once). An admin's."""
    _admin(principal)
    expires = None if body.expires_in_s is None else utcnow() + timedelta(seconds=body.expires_in_s)
    with db:
        row, secret = credentials.create_join_token(db, created_by=principal.user, expires_at=expires, uses=body.uses)
        db.commit()
        return JoinTokenPublic.of(row, secret)


@admin_router.get("/v1/worker-tokens", response_model=list[JoinTokenPublic])
def list_join_tokens(principal: PrincipalDep, db: SessionDep) -> list[JoinTokenPublic]:
    _admin(principal)
    with db:
        return [JoinTokenPublic.of(row) for row in credentials.join_tokens(db)]


@admin_router.delete("/v1/worker-tokens/{token_id}", response_model=JoinTokenPublic)
def revoke_join_token(token_id: str, principal: PrincipalDep, db: SessionDep) -> JoinTokenPublic:
    """No machine joins with it any more (those that joined keep their credentials)."""
    _admin(principal)
    with db:
        row = credentials.revoke_join_token(db, token_id=token_id)
        db.commit()
        return JoinTokenPublic.of(row)


@admin_router.get("/v1/runners", response_model=list[RunnerPublic])
def list_runners(principal: PrincipalDep, db: SessionDep) -> list[RunnerPublic]:
    """The joined machines' credentials, live and revoked."""
    _admin(principal)
    with db:
        return [RunnerPublic.of(r) for r in db.scalars(select(Credential).order_by(Credential.runner,
                                                                                  Credential.created_at))]


@admin_router.post("/v1/runners/{runner}/revoke", response_model=list[RunnerPublic])
def revoke_runner(runner: str, request: Request, principal: PrincipalDep, db: SessionDep) -> list[RunnerPublic]:
    """The machine's credential revoked: its worker's next call gets a 401, and it hands its jobs back and stops."""
    _admin(principal)
    with db:
        credentials.revoke_runner(db, runner=runner)
        db.commit()
        rows = [RunnerPublic.of(r) for r in db.scalars(select(Credential).where(Credential.runner == runner))]
        if not rows:
            raise NotFound(f"runner {runner!r} has never joined", field="runner")
        request.app.state.runners.clear()  # at once here; another API process's cache lets it by CACHE_S at most
        # Its jobs go back to the queue now: the machine can tell the API nothing more (its ranks stop at its next
        # lease renewal, refused).
        lifecycle.take_back(db, owned=Runner(runner, "").owns, detail=f"runner {runner}'s credential was revoked")
    return rows


def _admin(principal) -> None:
    if not principal.is_admin:
        raise Forbidden("only an admin manages the machines that join the pool", field="Authorization")


