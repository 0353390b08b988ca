"""Redis with a password: URLs that carry it, the check that a Redis asks for one, the loud warning where it does
not and jobs run their own code, and the password `trainjobs up` gives the Redis it starts itself."""

import logging
import subprocess
from contextlib import contextmanager

import psutil
import pytest
from fastapi.testclient import TestClient
from redis import Redis

from service.api.app import create_app
from service.cli.stack import REDIS_PASSWORD_FILE, Stack, redis_server_binary
from service.redis_auth import needs_no_password, warn_if_open, with_password
from service.settings import Settings
from tests.helpers import free_port, wait_for

OPEN_REDIS_URL = "redis://127.0.0.1:6379/0"  # the machine's own Redis (scripts/ensure-services.sh): no password


@contextmanager
def private_redis(*options: str):
    """A redis-server of the test's own on a free loopback port, keeping nothing on disk: its URL."""
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", *options], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: needs_no_password(url) is not None, 10, 0.05, what="redis-server to start")
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def locked_redis():
    """A private Redis that asks for a password: (its URL without it, the password)."""
    password = "s3cret-test-password"
    with private_redis("--requirepass", password) as url:
        yield url, password


@pytest.mark.parametrize(("url", "password", "expected"), [
    ("redis://127.0.0.1:6379/0", "pw", "redis://:pw@127.0.0.1:6379/0"),
    ("redis://queue:6380", "a/b@c:d", "redis://:a%2Fb%40c%3Ad@queue:6380"),  # quoted: the URL still parses
    ("redis://trainjobs@redis:6379/1", "pw", "redis://trainjobs:pw@redis:6379/1"),  # an ACL user keeps its name
    ("redis://:given@redis:6379/0", "other", "redis://:given@redis:6379/0"),  # the URL's own password wins
    ("rediss://[::1]:6379/0", "pw", "rediss://:pw@[::1]:6379/0"),
    ("redis://redis:6379/0", "", "redis://redis:6379/0"),  # an empty file adds nothing
])
def test_with_password_puts_the_password_in_a_url_that_names_none(url, password, expected):
    assert with_password(url, password) == expected


def test_needs_no_password_is_true_for_a_redis_that_answers_anyone():
    assert needs_no_password(OPEN_REDIS_URL) is True


def test_needs_no_password_is_false_for_a_redis_that_asks_for_one_even_when_the_url_has_it(locked_redis):
    url, password = locked_redis
    assert needs_no_password(url) is False
    assert needs_no_password(with_password(url, password)) is False  # the check never sends the URL's password


def test_needs_no_password_is_none_where_nothing_answers():
    assert needs_no_password(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5) is None


@pytest.mark.parametrize(("entrypoints", "opened", "loud"), [
    (True, True, True), (False, True, False), (True, False, False), (False, False, False)])
def test_warn_if_open_is_loud_only_for_an_open_redis_where_jobs_run_their_own_code(
        tmp_path, caplog, locked_redis, entrypoints, opened, loud):
    url, password = locked_redis
    settings = Settings(data_dir=tmp_path / "data", allow_entrypoints=entrypoints,
                        redis_url=OPEN_REDIS_URL if opened else with_password(url, password))
    log = logging.getLogger("test.redis_auth")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn_if_open(settings, who="worker", log=log) is opened
    assert ("SECURITY" in caplog.text) is loud
    assert password not in caplog.text


def test_warn_if_open_says_nothing_about_an_unreachable_redis(tmp_path, caplog):
    settings = Settings(data_dir=tmp_path / "data", allow_entrypoints=True,
                        redis_url=f"redis://127.0.0.1:{free_port()}/0")
    log = logging.getLogger("test.redis_auth")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn_if_open(settings, who="API", log=log) is False
    assert caplog.text == ""


def test_api_start_warns_of_an_open_redis_where_jobs_run_their_own_code(tmp_path, sqlite_url, caplog):
    with private_redis() as url:
        settings = Settings(data_dir=tmp_path / "data", database_url=sqlite_url, redis_url=url, auth=False,
                            allow_entrypoints=True, reconcile_s=3600)
        with caplog.at_level(logging.WARNING, logger="service.api.app"), TestClient(create_app(settings)) as api:
            assert api.get("/readyz").status_code == 200
    assert "SECURITY: the API's Redis" in caplog.text


def test_redis_password_file_puts_its_password_in_the_redis_url(tmp_path, locked_redis):
    url, password = locked_redis
    (tmp_path / "redis_password").write_text(password + "\n")  # as `openssl rand -hex 32 >` writes it
    settings = Settings(data_dir=tmp_path / "data", redis_url=url, redis_password_file=tmp_path / "redis_password")
    assert settings.redis_url == with_password(url, password)
    assert Redis.from_url(settings.redis_url).ping()


def test_up_gives_its_own_redis_a_kept_password_in_no_argv_or_environment(tmp_path):
    """The Redis `up` starts refuses a client without the password, which lives in the secrets dir (0600) and in
    no process's command line or environment; the next start reuses it."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = Settings(data_dir=tmp_path / "data", redis_url=url, auth=False)
    password_file = settings.resolved_secrets_dir / REDIS_PASSWORD_FILE
    with Stack(settings, port=free_port(), workers=0, quiet=True) as stack:
        assert needs_no_password(url) is False
        password = password_file.read_text().strip()
        assert password_file.stat().st_mode & 0o777 == 0o600
        assert password_file.parent.stat().st_mode & 0o777 == 0o700
        for name, proc in stack.procs:
            process = psutil.Process(proc.pid)
            assert password not in " ".join(process.cmdline()), name
            assert password not in "\n".join(f"{k}={v}" for k, v in process.environ().items()), name
        with stack.client() as api:  # the API got in: its readiness pings Redis
            assert api.get("/readyz").json()["checks"]["redis"] == "ok"
    with Stack(settings, port=free_port(), workers=0, quiet=True):
        assert password_file.read_text().strip() == password
        assert needs_no_password(url) is False
