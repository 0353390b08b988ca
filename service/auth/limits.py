"""API4 (unrestricted resource consumption): a per-token submission rate and a per-owner quota.

The body cap is ASGI middleware: service/api/middleware.py."""

import logging
import math
import time
import uuid
from collections.abc import Sequence

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.auth.tokens import Principal
from service.errors import Forbidden, TrainjobsError
from service.jobs.models import Job
from service.settings import Settings
from trainjobs.spec import JobSpec
from trainjobs.states import ACTIVE

log = logging.getLogger(__name__)
WINDOW_S = 60.0


class TooManyRequests(TrainjobsError):
    status_code = 429

    def __init__(self, message: str, *, retry_after_s: float | None = None, field: str | None = None):
        super().__init__(message, field=field)
        if retry_after_s is not None:
            self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def check_submission(db: Session, redis: Redis, settings: Settings, principal: Principal, spec: JobSpec) -> None:
    """Before a new job is stored: the caller's rights, rate and quota (in that order: cheapest refusal first)."""
    refused = check_submissions(db, redis, settings, [(principal, spec)])[0]
    if refused is not None:
        raise refused


def check_rights(principal: Principal, spec: JobSpec) -> None:
    if spec.entrypoint is not None and not principal.can_run_entrypoints:
        raise Forbidden(f"user {principal.user!r} may not run their own code (can_run_entrypoints is off)",
                        field="entrypoint")
    if not spec.preemptible and principal.role != "admin":
        raise Forbidden("only an admin may submit a job with preemptible: false (a higher-priority job may "
                        "otherwise hand it back to the queue, to resume from its checkpoint)", field="preemptible")


def check_submissions(db: Session, redis: Redis, settings: Settings,
                      asked: Sequence[tuple[Principal, JobSpec]]) -> list[TrainjobsError | None]:
    """check_submission of several submissions at once, each refusal its own (None: it may go on): the rates in
    one Redis round trip, the quotas in one query, each submission counted with those before it here.

    NOTE: one the quota let through counts against it here even if a later check refuses it (a missing
    package, say): within one batch, the quota errs on the side of refusing."""
    refused: list[TrainjobsError | None] = [None] * len(asked)
    for i, (principal, spec) in enumerate(asked):
        try:
            check_rights(principal, spec)
        except TrainjobsError as exc:
            refused[i] = exc
    rated = [i for i, (principal, _) in enumerate(asked) if refused[i] is None and principal.token_id is not None]
    waits = take_rate_slots(redis, [f"{settings.queue_prefix}:rate:{asked[i][0].token_id}" for i in rated],
                            settings.submit_rate_per_min)
    for i, wait in zip(rated, waits, strict=True):
        if wait is not None:
            refused[i] = TooManyRequests(f"more than {settings.submit_rate_per_min} submissions a minute with this "
                                         "token", retry_after_s=wait)
    owners = {principal.user for i, (principal, _) in enumerate(asked) if refused[i] is None}
    active = dict(db.execute(select(Job.owner, func.count()).where(Job.owner.in_(owners), Job.status.in_(ACTIVE))
                             .group_by(Job.owner)).all()) if owners else {}
    for i, (principal, _) in enumerate(asked):
        if refused[i] is not None:
            continue
        count = active.get(principal.user, 0)
        if count >= settings.quota_active_jobs:
            refused[i] = TooManyRequests(f"quota: {principal.user!r} has {count} queued or running jobs (limit "
                                         f"{settings.quota_active_jobs}); wait for some to finish or cancel some",
                                         retry_after_s=WINDOW_S, field="quota")
        else:
            active[principal.user] = count + 1
    return refused


# One round trip, atomic: requests at once cannot both take the last slot. KEYS[1] the token's window (a sorted set
# of request ids by time); ARGV: now, window, limit, a new id. Returns -1 (taken) or the oldest entry's time.
RATE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, ARGV[1] - ARGV[2])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return oldest[2] or ARGV[1]
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], math.ceil(ARGV[2]) + 1)
return -1
"""


def take_rate_slot(redis: Redis, key: str, per_minute: int) -> float | None:
    """A sliding-window log in a sorted set: None if this request may go, else seconds until a slot frees."""
    return take_rate_slots(redis, [key], per_minute)[0]


def take_rate_slots(redis: Redis, keys: Sequence[str], per_minute: int) -> list[float | None]:
    """take_rate_slot for each of keys in turn (a key may repeat), in one round trip.

    Shared by every API process through Redis. If Redis is down the submissions go ahead: the database is
    the truth and the quota still holds; a lost rate limit is the smaller harm than refusing all work.
    """
    if not keys:
        return []
    now = time.time()
    try:
        with redis.pipeline(transaction=False) as pipe:
            for key in keys:  # EVAL, not a Script's EVALSHA: a pipeline of those asks SCRIPT EXISTS first
                pipe.eval(RATE_SLOT, 1, key, repr(now), WINDOW_S, per_minute, uuid.uuid4().hex)
            oldest = [float(found) for found in pipe.execute()]
    except RedisError:
        log.warning("rate limit unavailable (Redis); letting the submission through")
        return [None] * len(keys)
    return [None if found < 0 else max(0.0, found + WINDOW_S - now) for found in oldest]
