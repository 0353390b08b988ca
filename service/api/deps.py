"""Annotated dependency aliases that keep routes to a few lines."""

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from redis import Redis
from sqlalchemy.orm import Session

from service.settings import Settings

# The largest values the database's integer columns hold (PostgreSQL's INTEGER and BIGINT; SQLite's are all
# 64-bit): a number in a request past its column's is a 422 naming it, not a query that fails in the database.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def get_db(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def get_redis(request: Request) -> Redis:
    return request.app.state.redis


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


SessionDep = Annotated[Session, Depends(get_db)]
RedisDep = Annotated[Redis, Depends(get_redis)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
