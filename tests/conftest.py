"""Fixtures on the real services: PostgreSQL and SQLite, Redis (db 15, flushed around each test)."""

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis
from sqlalchemy import create_engine, text

from service import migrate
from service.api.app import create_app
from service.models import Base
from service.settings import Settings

POSTGRES_URL = os.environ.get("TRAINJOBS_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TRAINJOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
QUEUE_PREFIX = f"tjtest{os.getpid()}"


def _reset_postgres() -> None:
    engine = create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(scope="session")
def postgres_url() -> str:
    _reset_postgres()
    migrate.upgrade(POSTGRES_URL)
    return POSTGRES_URL


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'trainjobs.db'}"
    migrate.upgrade(url)
    return url


# Kept by triggers on jobs: emptied after the jobs, whose deletion appends their -1s.
COUNT_TABLES = ("job_counts", "job_count_deltas")


def _empty_tables(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            if table.name not in COUNT_TABLES:
                conn.execute(table.delete())
        for name in COUNT_TABLES:
            conn.execute(Base.metadata.tables[name].delete())
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request) -> str:
    """The same test on the embedded default and on the production database."""
    url = request.getfixturevalue(f"{request.param}_url")
    _empty_tables(url)
    return url


@pytest.fixture
def fresh_postgres(postgres_url):
    """An empty schema of the test database, for migrations run down and up apart from the session's tables."""
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS migrations_apart CASCADE"))
        conn.execute(text("CREATE SCHEMA migrations_apart"))
    yield f"{postgres_url}?options=-csearch_path%3Dmigrations_apart"
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA migrations_apart CASCADE"))
    engine.dispose()


@pytest.fixture
def redis() -> Redis:
    conn = Redis.from_url(REDIS_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def settings(db_url, tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=db_url, redis_url=REDIS_URL,
                    queue_prefix=QUEUE_PREFIX, reconcile_s=3600)


def admin_token(settings: Settings) -> str:
    """The admin token the app wrote on its first start (tables are emptied per test: every app is a first)."""
    return settings.admin_token_file.read_text().strip()


@pytest.fixture
def client(settings, redis) -> TestClient:
    """A TestClient on the app, carrying the admin token."""
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        yield c


@pytest.fixture
def api(stack):
    """A client with the admin token on the module's live `stack` (tests.helpers.module_stack)."""
    with stack.client(timeout=10) as c:
        yield c


def mlp_spec(**overrides) -> dict:
    spec = {
        "name": "mlp-ddp",
        "strategy": "ddp",
        "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"},
        "model": {"type": "mlp", "hidden": [16]},
        "data": {"type": "synthetic_regression", "num_samples": 512, "batch_size": 16},
        "optimizer": {"type": "adamw", "lr": 0.01},
        "train": {"max_steps": 20, "log_every": 5, "seed": 0},
    }
    spec.update(overrides)
    return spec
