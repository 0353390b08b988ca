"""Engine, sessions and the declarative base shared by every domain's models."""

from datetime import UTC, datetime

from sqlalchemy import DateTime, Engine, create_engine, event
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

# What a database that is down, restarting or out of reach raises (psycopg: refused, "terminating connection",
# "the database system is starting up"; a pooled connection closed under us). Not a bug: wait and try again.
UNREACHABLE = (OperationalError, InterfaceError)
CONNECT_TIMEOUT_S = 5


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime; use service.db.utcnow()")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    pass


IDLE_IN_TRANSACTION_S = 30.0  # see make_engine


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # NOTE: API, worker and supervisor write the same file; WAL plus a busy timeout
        # turns "database is locked" into a short wait.
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # NOTE: a bounded connect: a host out of reach (not refusing) would otherwise hold a supervisor for the TCP
    # timeout, minutes, past its lease. pool_size covers the API's 40 threadpool threads: a smaller pool closes
    # each connection past it when it is returned, so a busy API opened a PostgreSQL connection (a backend
    # process) for most requests. Connections open only as they are needed: a worker keeps its few.
    engine = create_engine(url, pool_pre_ping=True, pool_size=40, max_overflow=10,
                           connect_args={"connect_timeout": CONNECT_TIMEOUT_S})

    # NOTE: a process frozen inside a transaction (a paused VM, SIGSTOP) would hold its row locks for as long as
    # it is frozen, and the sweeper, which locks a job's row to expire its lease, would wait on it as long. Our
    # transactions are short: one left idle for IDLE_IN_TRANSACTION_S is a frozen holder, and the server ends
    # its session (its locks go; the process, should it wake, finds its connection closed: an outage to it).
    @event.listens_for(engine, "connect")
    def _postgres_session(dbapi_conn, _record):
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET idle_in_transaction_session_timeout = {int(IDLE_IN_TRANSACTION_S * 1000)}")
        dbapi_conn.commit()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
