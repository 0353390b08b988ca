"""The principal cache (service/auth/cache.py): a token seen lately costs no database read, and a revoked one
is refused by every API process within 1 s."""

import sys
import time

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.auth import cache as principal_cache
from service.auth import tokens
from service.auth.models import ApiToken
from service.db import utcnow
from tests.conftest import admin_token
from tests.helpers import free_port, live_stack


def make_token(url: str, user: str) -> tuple[str, str]:
    engine = create_engine(url)
    with Session(engine) as db:
        row, secret = tokens.create(db, name=f"{user}-token", user=user)
        token_id = row.id
    engine.dispose()
    return token_id, secret


def revoke_behind_the_apis_back(url: str, token_id: str) -> None:
    engine = create_engine(url)
    with Session(engine) as db:
        db.execute(update(ApiToken).where(ApiToken.id == token_id).values(revoked_at=utcnow()))
        db.commit()
    engine.dispose()


@pytest.mark.alone  # refused within 1 s
def test_a_revoked_token_is_refused_within_1s_by_a_second_api_process(postgres_url, tmp_path):
    with live_stack(postgres_url, tmp_path, name="pcache", workers=0) as stack:
        port = free_port()
        stack._spawn("api2", [sys.executable, "-m", "uvicorn", "service.api.asgi:app", "--host", "127.0.0.1",
                              "--port", str(port), "--log-level", "warning"])
        second = f"http://127.0.0.1:{port}"
        stack.api_url, first = second, stack.api_url
        stack._wait_ready()
        token_id, secret = make_token(postgres_url, "bob")
        bob = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(headers=bob, timeout=5) as c:
            for api in (first, second, first, second):  # each process has it cached
                assert c.get(f"{api}/v1/me").status_code == 200
            assert c.delete(f"{first}/v1/tokens/{token_id}").status_code == 200
            revoked = time.monotonic()
            assert c.get(f"{first}/v1/me").status_code == 401  # the process that revoked it: at once
            while (status := c.get(f"{second}/v1/me").status_code) == 200 and time.monotonic() - revoked < 3:
                time.sleep(0.02)
            waited = time.monotonic() - revoked
        print(f"the second process refused it after {waited:.3f}s")
        assert status == 401 and waited < 1.0, f"the second process took {waited:.2f}s"


def test_a_token_seen_lately_is_answered_from_the_cache_until_the_epoch_moves(client, settings):
    token_id, secret = make_token(settings.resolved_database_url, "bob")
    bob = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/me", headers=bob).status_code == 200
    # Revoked in the database alone (no route does this): the cache still answers, proving it is read...
    revoke_behind_the_apis_back(settings.resolved_database_url, token_id)
    assert client.get("/v1/me", headers=bob).status_code == 200
    # ...until another process's revocation sets a new epoch: read within CHECK_EVERY_S, it drops everything.
    with TestClient(create_app(settings)) as other:
        other.app.state.principals.revoke_everywhere()
    time.sleep(principal_cache.CHECK_EVERY_S + 0.05)
    assert client.get("/v1/me", headers=bob).status_code == 401


def test_without_redis_every_request_is_checked_in_the_database(client, settings):
    token_id, secret = make_token(settings.resolved_database_url, "bob")
    bob = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/me", headers=bob).status_code == 200
    principals = client.app.state.principals
    principals.redis = type(principals.redis).from_url("redis://127.0.0.1:1", socket_connect_timeout=1)  # refused
    principals.next_check = 0.0
    assert client.get("/v1/me", headers=bob).status_code == 200  # from the database
    revoke_behind_the_apis_back(settings.resolved_database_url, token_id)
    assert client.get("/v1/me", headers=bob).status_code == 401  # no cache without the epoch
    assert client.get("/v1/me", headers={"Authorization": f"Bearer {admin_token(settings)}"}).status_code == 200


def test_granting_a_users_right_is_seen_by_their_cached_tokens(client, settings):
    _, secret = make_token(settings.resolved_database_url, "bob")
    bob = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/me", headers=bob).json()["can_run_entrypoints"] is False
    made = client.post("/v1/tokens", json={"name": "bob-ci", "user": "bob", "can_run_entrypoints": True})
    assert made.status_code == 201
    assert client.get("/v1/me", headers=bob).json()["can_run_entrypoints"] is True


@pytest.mark.alone  # refused within 1 s
def test_trainjobs_api_workers_2_runs_two_processes_and_a_revoked_token_leaves_both_within_1s(postgres_url, tmp_path):
    with live_stack(postgres_url, tmp_path, name="apiw", workers=0) as stack:
        port = free_port()
        stack._spawn("api2", [sys.executable, "-m", "service.cli.main", "api", "--port", str(port), "--workers", "2"])
        supervisor = stack.procs[-1][1]
        pair = f"http://127.0.0.1:{port}"
        stack.api_url, first = pair, stack.api_url
        stack._wait_ready()
        serving = [p for p in psutil.Process(supervisor.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(serving) == 2, [p.cmdline() for p in psutil.Process(supervisor.pid).children()]
        token_id, secret = make_token(postgres_url, "bob")
        bob = {"Authorization": f"Bearer {secret}"}
        # A new connection each: the kernel hands each to either process, so both cache the token.
        assert [httpx.get(f"{pair}/v1/me", headers=bob).status_code for _ in range(20)] == [200] * 20
        assert httpx.delete(f"{first}/v1/tokens/{token_id}", headers=bob).status_code == 200
        revoked = time.monotonic()
        refused_since, refused_in_a_row = revoked, 0  # from the first of the refusals in a row that ends the loop
        while refused_in_a_row < 20 and time.monotonic() - revoked < 3:
            asked = time.monotonic()
            if httpx.get(f"{pair}/v1/me", headers=bob).status_code == 401:
                refused_since, refused_in_a_row = (asked, 1) if refused_in_a_row == 0 else (refused_since,
                                                                                          refused_in_a_row + 1)
            else:
                refused_in_a_row = 0
        waited = refused_since - revoked
        print(f"both processes refused it from {waited:.3f}s on")
        assert refused_in_a_row == 20 and waited < 1.0, f"refused by both from {waited:.2f}s on"
        supervisor.terminate()
        assert supervisor.wait(timeout=15) == 0
        assert not [p for p in serving if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_requests_that_find_the_epoch_due_share_one_refresh_and_a_cancelled_one_leaves_it_running(redis):
    """Under load every request in flight found the epoch due at once: each read it itself, a herd of threadpool
    turns every CHECK_EVERY_S. Now one reads it and the rest wait for that read."""
    import asyncio
    import threading

    cache = principal_cache.PrincipalCache(redis, "test:auth:epoch")
    reads, release = [], threading.Event()
    refresh = cache.refresh

    def slow_refresh():
        reads.append(1)
        release.wait(5)
        refresh()

    cache.refresh = slow_refresh

    async def many():
        waiting = [asyncio.ensure_future(cache.refresh_once()) for _ in range(20)]
        await asyncio.sleep(0.1)
        waiting[0].cancel()  # a client gone: the others' refresh goes on
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*waiting[1:])

    asyncio.run(many())
    assert len(reads) == 1 and not cache.due() and cache.usable


def test_requests_with_one_token_that_miss_the_cache_at_once_share_one_database_read(redis):
    """An API just started and 50 clients polling: each request read the token in the database in its own
    thread. Now the first reads it and the rest of that generation wait for it; one after a drop reads anew."""
    import asyncio
    import threading

    cache = principal_cache.PrincipalCache(redis, "test:auth:epoch")
    reads, release = [], threading.Event()
    alice = tokens.Principal(user="alice", role="user", token_id=1, can_run_entrypoints=False)

    def authenticate():
        reads.append(1)
        release.wait(5)
        return alice

    async def many():
        waiting = [asyncio.ensure_future(cache.authenticate_once("d", 0, authenticate)) for _ in range(20)]
        await asyncio.sleep(0.1)
        waiting[0].cancel()
        after_drop = asyncio.ensure_future(cache.authenticate_once("d", 1, authenticate))
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*waiting[1:], after_drop)

    assert asyncio.run(many()) == [alice] * 20
    assert len(reads) == 2 and cache.authenticating == {}
