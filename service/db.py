"""Engine, sessions and the declarative base shared by every domain's models."""

import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import DateTime, Engine, create_engine, event, text
from sqlalchemy.exc import InterfaceError, OperationalError, ProgrammingError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

# What a database that is down, restarting or out of reach raises (psycopg: refused, "terminating connection",
# "the database system is starting up"; a pooled connection closed under us). Not a bug: wait and try again.
UNREACHABLE = (OperationalError, InterfaceError)
CONNECT_TIMEOUT_S = 5
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout that ran out
# SQLSTATE classes PostgreSQL raises as OperationalError for a statement it refuses, not an outage: 54 (a program
# limit, e.g. "stack depth limit exceeded" for a long IN list) and 22 (a data exception psycopg maps there).
REFUSED_CLASSES = ("54", "22")


def is_refusal(exc: BaseException) -> bool:
    """An error among UNREACHABLE that is the database refusing a statement: retrying it the same way fails again."""
    state = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
    return isinstance(exc, OperationalError) and state[:2] in REFUSED_CLASSES

log = logging.getLogger(__name__)


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


def session_name(name: str) -> str:
    """`name` as PostgreSQL keeps it in application_name (printable ASCII, at most 63 bytes), so a worker's
    sessions can be found by the name its attempts carry (end_sessions)."""
    return "".join(c if " " <= c <= "~" else "?" for c in name)[:63]


def make_private_dir(path: Path) -> None:
    """The data dir: made 0700 (umask 077) where it is new; its parents as the umask says. An operator's folder
    that already exists keeps its mode: theirs to set. Jobs reach their parts through the sandbox, not by it."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)  # also where a umask wider than 077 narrowed mkdir's mode


def make_private_sqlite(url: str) -> None:
    """The SQLite file made 0600 before SQLite makes it 0644 (the umask's): every owner's logs, jobs and webhook
    secrets are in it. SQLite gives its -wal and -shm files the database's own mode."""
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return
    path = Path(url.removeprefix("sqlite:///").partition("?")[0])
    if not path.name or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass  # another process made it first, 0600 too


def make_engine(url: str, *, application_name: str | None = None) -> Engine:
    """An engine on `url`; on PostgreSQL its sessions carry `application_name` (a worker's: its name)."""
    if url.startswith("sqlite"):
        make_private_sqlite(url)
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
    connect_args: dict = {"connect_timeout": CONNECT_TIMEOUT_S}
    if application_name is not None:
        connect_args["application_name"] = session_name(application_name)
    engine = create_engine(url, pool_pre_ping=True, pool_size=40, max_overflow=10, connect_args=connect_args)

    # NOTE: a process frozen inside a transaction (a paused VM, SIGSTOP) would hold its row locks for as long as
    # it is frozen. Our transactions are short: one left idle for IDLE_IN_TRANSACTION_S is a frozen holder, and
    # the server ends its session (its locks go; the process, should it wake, finds its connection closed: an
    # outage to it). Not always, though: frozen inside a psycopg pipeline (executemany) its session stays
    # `active`, and after one (psycopg sends a Flush after the Sync, which disarms the timer) `idle in
    # transaction` with no timer running, until its next statement. So the sweeper does not count on this
    # alone: it ends the sessions of a worker whose lease ran out that still hold its job (end_sessions).
    @event.listens_for(engine, "connect")
    def _postgres_session(dbapi_conn, _record):
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET idle_in_transaction_session_timeout = {int(IDLE_IN_TRANSACTION_S * 1000)}")
        dbapi_conn.commit()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def lock_within(db: Session, wait_s: float, lock: Callable[[], object]) -> bool:
    """Call `lock` (it runs a SELECT ... FOR UPDATE), waiting at most wait_s for another transaction's lock; False
    if it was still held then, and the transaction goes on without it. PostgreSQL's; SQLite locks the whole file
    on its first write instead, and waits for it as ever (its busy timeout)."""
    if db.get_bind().dialect.name != "postgresql":
        lock()
        return True
    try:
        with db.begin_nested():  # a lock_timeout that runs out rolls back to here (and its SET LOCAL with it)
            db.execute(text(f"SET LOCAL lock_timeout = {max(1, int(wait_s * 1000))}"))
            lock()
            db.execute(text("SET LOCAL lock_timeout TO DEFAULT"))
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        return False
    return True


def end_sessions(db: Session, *, name: str, began_before: datetime, wait_s: float) -> list[int]:
    """End this database's sessions named `name` (make_engine's application_name) whose transaction began before
    `began_before`, waiting up to wait_s for each to go: their locks go with them, their transactions roll back.
    The pids ended; none on SQLite, which has no sessions to end."""
    if db.get_bind().dialect.name != "postgresql":
        return []
    try:
        with db.begin_nested():
            # MATERIALIZED: the filter is applied first; pg_terminate_backend runs for the chosen sessions only.
            return list(db.scalars(text(
                "WITH chosen AS MATERIALIZED (SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = :name AND xact_start < :began_before AND pid <> pg_backend_pid()) "
                "SELECT pid FROM chosen WHERE pg_terminate_backend(pid, :wait_ms)"),
                {"name": session_name(name), "began_before": began_before, "wait_ms": max(1, int(wait_s * 1000))}))
    except ProgrammingError as exc:  # a role that may not end them (a superuser's sessions): the lease waits
        log.warning("could not end the sessions of %s: %s", name, exc.orig)
        return []
