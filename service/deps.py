"""The dependencies every router shares: the request's session, Redis and settings as `Annotated` aliases, and the
largest integers a request may carry. A bottom module: it imports no domain, no router and not the app."""

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import Depends, Request
from redis import Redis
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.settings import Settings

# The largest values the database's integer columns hold (PostgreSQL's INTEGER and BIGINT; SQLite's are all
# 64-bit): a number in a request past its column's is a 422 naming it, not a query that fails in the database.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


async def get_db(request: Request) -> AsyncIterator[Session]:
    """The request's session. Made without a thread (making one does no I/O), and closed in the threadpool only
    while it still holds a transaction (its ROLLBACK is a round trip): a route that closed it costs no turn."""
    session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        if session.in_transaction():
            with anyio.CancelScope(shield=True):  # a client gone mid-request must not leak the connection
                await run_in_threadpool(session.close)
        else:
            session.close()


# NOTE: async, though they do no I/O: FastAPI runs a plain `def` dependency in the threadpool, a thread hop per
# request for an attribute read.
async def get_redis(request: Request) -> Redis:
    return request.app.state.redis


async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_db)]
RedisDep = Annotated[Redis, Depends(get_redis)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
