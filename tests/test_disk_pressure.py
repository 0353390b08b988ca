"""A full disk is a state, not an outage: reads go on, /readyz says what is wrong (on a real full tmpfs)."""

import errno
import os
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, update
from sqlalchemy.exc import OperationalError

from service import migrate
from service.api.app import create_app
from service.auth.models import ApiToken
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL, admin_token

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a disk that fills) needs root")

DISK_BYTES = 16 * 2**20
MIN_FREE = 2**20  # the empty tmpfs has more than this free, the filled one less


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 16 MiB tmpfs, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)], check=True)
    yield mount
    if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], check=True)  # a file still open: detach it all the same


@pytest.fixture
def settings(small_disk: Path, redis, monkeypatch) -> Settings:
    """`trainjobs up`'s layout, SQLite in the data dir, on the small disk."""
    monkeypatch.setenv("TRAINJOBS_MIN_FREE_BYTES", str(MIN_FREE))
    settings = Settings(data_dir=small_disk / "data", redis_url=REDIS_URL, queue_prefix=QUEUE_PREFIX,
                        reconcile_s=3600)
    settings.data_dir.mkdir()
    migrate.upgrade(settings.resolved_database_url)
    return settings


def fill(disk: Path) -> Path:
    """A file that takes every free byte of the disk."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * 2**20
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def last_used_at(settings: Settings, user: str = "admin"):
    engine = create_engine(settings.resolved_database_url)
    with engine.connect() as conn:
        value = conn.scalar(select(ApiToken.last_used_at).where(ApiToken.user == user))
    engine.dispose()
    return value


def assert_writes_fail(settings: Settings) -> None:
    """The precondition: the database really refuses writes (else the tests below prove nothing)."""
    engine = create_engine(settings.resolved_database_url)
    with pytest.raises(OperationalError, match="full"), engine.begin() as conn:
        conn.execute(update(ApiToken).values(name=ApiToken.name + "-touched"))
    engine.dispose()


def test_a_token_whose_last_used_at_touch_fails_is_still_served(settings, small_disk):
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        assert last_used_at(settings) is None  # so this request's authentication writes it
        fill(small_disk)
        assert_writes_fail(settings)
        r = client.get("/v1/jobs")
        assert r.status_code == 200, r.text
        assert client.get("/v1/jobs").status_code == 200  # and again (the cached principal)
    assert last_used_at(settings) is None  # the touch did fail: it was skipped, not a 503


def test_readyz_on_a_full_disk_is_503_naming_the_data_dir_until_space_is_freed(settings, small_disk):
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").status_code == 200
        filler = fill(small_disk)
        r = client.get("/readyz")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "not ready" and body["checks"] == {"database": "ok", "redis": "ok"}
        assert set(body["failed"]) == {"data_dir"}
        assert str(settings.data_dir.resolve()) in body["failed"]["data_dir"]
        assert body["failed"]["data_dir"].endswith("needs 1 MiB")
        filler.unlink()
        r = client.get("/readyz")
        assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["failed"] == {}
