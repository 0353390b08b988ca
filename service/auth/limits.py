"""API4 (unrestricted resource consumption): a per-token submission rate and a per-owner quota.

The body cap is ASGI middleware: service/api/middleware.py."""

import logging
import math
import time
import uuid

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
    if spec.entrypoint is not None and not principal.can_run_entrypoints:
        raise Forbidden(f"user {principal.user!r} may not run their own code (can_run_entrypoints is off)",
                        field="entrypoint")
    if not spec.preemptible and principal.role != "admin":
        raise Forbidden("only an admin may submit a job with preemptible: false (a higher-priority job may "
                        "otherwise hand it back to the queue, to resume from its checkpoint)", field="preemptible")
    if principal.token_id is not None:
        wait = take_rate_slot(redis, f"{settings.queue_prefix}:rate:{principal.token_id}",
                              settings.submit_rate_per_min)
        if wait is not None:
            raise TooManyRequests(f"more than {settings.submit_rate_per_min} submissions a minute with this token",
                                  retry_after_s=wait)
    active = db.scalar(select(func.count()).select_from(Job).where(Job.owner == principal.user,
                                                                   Job.status.in_(ACTIVE)))
    if active >= settings.quota_active_jobs:
        raise TooManyRequests(f"quota: {principal.user!r} has {active} queued or running jobs (limit "
                              f"{settings.quota_active_jobs}); wait for some to finish or cancel some",
                              retry_after_s=WINDOW_S, field="quota")


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
    """A sliding-window log in a sorted set: None if this request may go, else seconds until a slot frees.

    Shared by every API process through Redis. If Redis is down the submission goes ahead: the database is
    the truth and the quota still holds; a lost rate limit is the smaller harm than refusing all work.
    """
    now = time.time()
    try:
        oldest = float(redis.register_script(RATE_SLOT)(keys=[key], args=[repr(now), WINDOW_S, per_minute,
                                                                          uuid.uuid4().hex]))
    except RedisError:
        log.warning("rate limit unavailable (Redis); letting the submission through")
        return None
    return None if oldest < 0 else max(0.0, oldest + WINDOW_S - now)
