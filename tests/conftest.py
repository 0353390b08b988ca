"""Fixtures on the real services: PostgreSQL and SQLite, Redis (db 15, flushed around each test).

Under pytest-xdist (`make test` runs `pytest -n 2`) each worker has a database and a Redis db of its own, so
one worker's schema reset or FLUSHDB never reaches another's: worker gwN uses the database `<db>_gwN`
(created from the server's `postgres` database if missing) and the Redis db `<db> - N` (15, 14, 13 by default).
"""

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from service import migrate
from service.api.app import create_app
from service.models import Base
from service.settings import Settings

CONFIGURED_POSTGRES_URL = os.environ.get("TRAINJOBS_TEST_POSTGRES_URL",
                                         "postgresql+psycopg://postgres@127.0.0.1:5432/test")
CONFIGURED_REDIS_URL = os.environ.get("TRAINJOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# The tests start database workers (a worker with no API) beside joined ones: `trainjobs worker` refuses one unless
# asked for by name (tests/test_worker_join.py pins the refusal).
os.environ["TRAINJOBS_WORKER_DATABASE"] = "1"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest-xdist; None in a plain run


def worker_postgres_url(url: str, worker: str | None) -> str:
    """The configured database itself in a plain run, `<db>_<worker>` in an xdist worker."""
    if worker is None:
        return url
    parsed = make_url(url)
    return parsed.set(database=f"{parsed.database}_{worker}").render_as_string(hide_password=False)


def worker_redis_url(url: str, worker: str | None) -> str:
    """The configured Redis db in a plain run (and in gw0), that db minus N in worker gwN: counting down, so
    the default 15 leaves the low dbs alone."""
    if worker is None:
        return url
    base, _, db = url.rpartition("/")
    index = int(worker.removeprefix("gw"))
    db_number = int(db or 0) - index
    if db_number < 0:
        raise pytest.UsageError(f"worker {worker} would use Redis db {db_number}: configure a higher db than {url} "
                                "(TRAINJOBS_TEST_REDIS_URL) or run fewer workers")
    return f"{base}/{db_number}"


POSTGRES_URL = worker_postgres_url(CONFIGURED_POSTGRES_URL, XDIST_WORKER)
REDIS_URL = worker_redis_url(CONFIGURED_REDIS_URL, XDIST_WORKER)
QUEUE_PREFIX = f"tjtest{os.getpid()}"


def _create_postgres_database() -> None:
    """A worker's database is made on first use (a fresh machine has only `test` and `postgres`)."""
    if XDIST_WORKER is None:
        return  # the configured database exists, as it always had to
    name = make_url(POSTGRES_URL).database
    engine = create_engine(make_url(POSTGRES_URL).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        if conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}) is None:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()


def _reset_postgres() -> None:
    _create_postgres_database()
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
