"""Liveness (/healthz: the process answers) and readiness (/readyz: it can do its work, or 503 naming why not)."""

import os
import shutil
from pathlib import Path

from fastapi import APIRouter, Response
from redis import Redis
from sqlalchemy import false, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from service.auth.models import ApiToken
from service.deps import RedisDep, SessionDep, SettingsDep
from service.jobs import queue
from service.settings import Settings

router = APIRouter(tags=["health"])

# Below this much free space a data or storage folder is "not ready": SQLite, logs and checkpoints fail on a
# full disk. Read from the environment variable TRAINJOBS_MIN_FREE_BYTES on every /readyz (settings.py is
# not this module's; a probe reads it so rarely that parsing it each time costs nothing).
MIN_FREE_BYTES = 2**30
MIN_FREE_ENV = "TRAINJOBS_MIN_FREE_BYTES"


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(db: SessionDep, redis: RedisDep, settings: SettingsDep, response: Response) -> dict:
    """200 when the database reads and accepts writes, Redis answers and the folders have space; else 503 with
    `failed` naming each check that did not pass. `warnings`: what works but is wrong (another stack's jobs in
    this stack's queues)."""
    checks = {"database": check_database(db), "redis": check_redis(redis)}
    failed = {name: result for name, result in checks.items() if result != "ok"}
    failed |= check_free_space(settings)
    response.status_code = 503 if failed else 200
    warnings = [said] if checks["redis"] == "ok" and (said := queue.shared_warning(
        redis, prefix=settings.queue_prefix)) else []
    return {"status": "not ready" if failed else "ready", "checks": checks, "failed": failed, "warnings": warnings}


def check_database(db: Session) -> str:
    try:
        db.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure
        return f"error: {type(exc).__name__}"
    if db.get_bind().dialect.name != "postgresql":
        # NOTE: SQLite's write probe would take the file's one write lock, and wait out the busy timeout (30 s)
        # behind a busy writer; its full disk shows in the free space of its folder (check_free_space).
        return "ok"
    try:
        # A write of no row, rolled back: refused by a read-only server (a standby after a failover,
        # default_transaction_read_only) without writing anything.
        db.execute(update(ApiToken).where(false()).values(last_used_at=None))
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"error: refuses writes ({type(exc).__name__})"
    finally:
        db.rollback()


def check_redis(redis: Redis) -> str:
    try:
        redis.ping()
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"error: {type(exc).__name__}"


def check_free_space(settings: Settings) -> dict[str, str]:
    """Each folder with too little free space (or an unreadable threshold), by name, with what is wrong."""
    try:
        needed = min_free_bytes()
    except ValueError as exc:
        return {"min_free_bytes": str(exc)}
    failed = {}
    for name, folder in folders_to_watch(settings).items():
        try:
            free = shutil.disk_usage(folder).free
        except OSError as exc:
            failed[name] = f"cannot read the free space under {folder}: {exc.strerror}"
            continue
        if free < needed:
            failed[name] = f"{format_bytes(free)} free under {folder}, needs {format_bytes(needed)}"
    return failed


def min_free_bytes() -> int:
    raw = os.environ.get(MIN_FREE_ENV)
    if raw is None:
        return MIN_FREE_BYTES
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{MIN_FREE_ENV}={raw!r} is not a whole number of bytes") from None


def folders_to_watch(settings: Settings) -> dict[str, Path]:
    """The data dir, the storage dir once made, and a SQLite database's folder when it is not the data dir."""
    data_dir = settings.data_dir.resolve()
    folders = {"data_dir": data_dir}
    if settings.resolved_storage_dir.is_dir():
        folders["storage_dir"] = settings.resolved_storage_dir
    url = make_url(settings.resolved_database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        database_dir = Path(url.database).resolve().parent
        if database_dir != data_dir:
            folders["database_dir"] = database_dir
    return folders


def format_bytes(n: int) -> str:
    """`512 B`, `12 MiB`, `1.5 GiB`: what an operator reads in a probe's answer."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f}".removesuffix(".0") + f" {unit}"
