"""Principals of recently seen tokens, kept in the API process, forgotten on every process within 1 s of a
revocation: a job read pays no database round trip for its token.

Every write that can change what a token may do (a revocation, a token that changes its user's rights) sets
a new random *revocation epoch* in Redis. Each process reads the epoch at most every CHECK_EVERY_S, on the
request path, and drops its whole cache when it changed. Without Redis the cache is not used (every request
authenticates against the database) until Redis answers again: a revocation is never missed for an outage.
"""

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime

from redis import Redis
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from service.auth.tokens import Principal
from service.db import utcnow

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5  # a revoked token is refused on every process within this (plus one request)
RETRY_AFTER_S = 5.0  # Redis did not answer: read it again after this (the cache is off meanwhile)
MAX_AGE_S = 30.0  # so last_used_at (written on a database authentication) stays within ~90 s
MAX_ENTRIES = 10_000


class PrincipalCache:
    """Token hash → (principal, its token's expiry, when cached), valid while the revocation epoch holds."""

    def __init__(self, redis: Redis, key: str, clock: Callable[[], float] = time.monotonic):
        self.redis, self.key, self.clock = redis, key, clock
        self.entries: dict[str, tuple[Principal, datetime | None, float]] = {}
        self.epoch: bytes | None = None
        self.generation = 0  # bumped by every drop: an authentication that began before one is not cached
        self.usable = False
        self.next_check = 0.0
        self.lock = threading.Lock()
        self.refreshing: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
        self.authenticating: dict[tuple[str, int], asyncio.Task] = {}  # (token hash, generation) → its read

    def due(self) -> bool:
        """Whether the epoch must be read before the cache is used (then call refresh, which may block)."""
        return self.clock() >= self.next_check

    async def refresh_once(self) -> None:
        """refresh, from the event loop, once for all the requests that find it due meanwhile: the first runs it
        in the threadpool, the rest wait for that one. (Each its own, 50 connections made a herd of threads
        every CHECK_EVERY_S, each with its Redis GET: the tail of the reads' latency, bench/README.md.)"""
        loop = asyncio.get_running_loop()
        if self.refreshing is None or self.refreshing[0] is not loop or self.refreshing[1].done():
            self.refreshing = (loop, loop.create_task(run_in_threadpool(self.refresh)))
        await asyncio.shield(self.refreshing[1])  # a request cancelled does not cancel the others' refresh

    async def authenticate_once(self, digest: str, generation: int,
                                authenticate: Callable[[], Principal | None]) -> Principal | None:
        """authenticate() in the threadpool, once for all the requests with this token that miss the cache at once
        (an API just started, 50 clients polling: each its own database read, a herd of threads at the first
        requests). Only requests of one generation share a read: one that began after a drop reads anew."""
        loop = asyncio.get_running_loop()
        key = (digest, generation)
        task = self.authenticating.get(key)
        if task is None or task.done() or task.get_loop() is not loop:
            task = loop.create_task(run_in_threadpool(authenticate))
            self.authenticating[key] = task
            task.add_done_callback(lambda done: self.authenticating.pop(key, None)
                                   if self.authenticating.get(key) is done else None)
        return await asyncio.shield(task)  # a request cancelled does not cancel the others' read

    def refresh(self) -> None:
        """Read the epoch (a blocking Redis GET); a new one drops every entry."""
        try:
            epoch = self.redis.get(self.key)
        except RedisError:
            log.warning("cannot read the revocation epoch from Redis: tokens are checked in the database")
            with self.lock:
                self._drop()
                self.usable, self.next_check = False, self.clock() + RETRY_AFTER_S
            return
        with self.lock:
            if epoch != self.epoch or not self.usable:
                self._drop()
                self.epoch = epoch
            self.usable, self.next_check = True, self.clock() + CHECK_EVERY_S

    def get(self, digest: str) -> tuple[Principal | None, int]:
        """The cached principal (None on a miss) and the generation to hand back to put()."""
        with self.lock:
            found = self.entries.get(digest) if self.usable else None
            generation = self.generation
        if found is None:
            return None, generation
        principal, expires_at, cached_at = found
        if (expires_at is not None and expires_at <= utcnow()) or self.clock() - cached_at > MAX_AGE_S:
            self.entries.pop(digest, None)
            return None, generation
        return principal, generation

    def put(self, digest: str, principal: Principal, expires_at: datetime | None, generation: int) -> None:
        """Keep a principal read from the database, unless the cache was dropped since that read began."""
        with self.lock:
            if not self.usable or generation != self.generation:
                return
            if len(self.entries) >= MAX_ENTRIES:
                self.entries.clear()
            self.entries[digest] = (principal, expires_at, self.clock())

    def revoke_everywhere(self) -> None:
        """After a committed change to a token or its user: this process forgets now, the others within
        CHECK_EVERY_S. NOTE: were Redis down for this write only, the others could keep an entry MAX_AGE_S."""
        with self.lock:
            self._drop()
        try:
            self.redis.set(self.key, secrets.token_hex(8))
        except RedisError:
            log.error("cannot set the revocation epoch in Redis: other API processes may accept the changed "
                      "token for up to %ss", MAX_AGE_S)

    def _drop(self) -> None:
        self.entries.clear()
        self.generation += 1
