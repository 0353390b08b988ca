"""Redis's password: put into a URL (from TRAINJOBS_REDIS_PASSWORD_FILE), and the check that a Redis needs one.

Redis is the queue. A Redis that answers without a password lets any process that reaches it push entries
onto the queues: workers run only their two job functions whatever an entry names (worker/dispatch.py), but
the queue itself, and the dispatch hints in it, are then anyone's.
"""

import logging
from typing import TYPE_CHECKING
from urllib.parse import quote, urlparse, urlunparse

from redis import Redis
from redis.exceptions import AuthenticationError, RedisError

if TYPE_CHECKING:  # settings imports this module (its validator): no import at run time
    from service.settings import Settings


def with_password(url: str, password: str) -> str:
    """`url` with `password` (and the user it names, if any); a URL that names a password already is kept."""
    parsed = urlparse(url)
    if parsed.password or not password:
        return url
    user = quote(parsed.username or "", safe="")
    host = parsed.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:{quote(password, safe='')}@{host}" + (f":{parsed.port}" if parsed.port else "")
    return urlunparse(parsed._replace(netloc=netloc))


def needs_no_password(url: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the Redis at `url` answers a PING from a client that gives no credentials: True (it does: open),
    False (it asks for a password), None (unreachable, or it answered something else)."""
    bare = Redis.from_url(_without_credentials(url), socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(bare.ping())
    except AuthenticationError:  # NOAUTH; before ConnectionError, of which redis-py makes it a kind
        return False
    except RedisError:
        return None
    finally:
        bare.close()


def warn_if_open(settings: "Settings", *, who: str, log: logging.Logger) -> bool:
    """Say loudly, at a process's start, that its Redis takes commands from anyone while jobs may run their own
    code (a job's script can reach it); returns whether that Redis needs no password."""
    is_open = needs_no_password(settings.redis_url) is True
    if is_open and settings.allow_entrypoints:
        log.warning(
            "SECURITY: the %s's Redis (%s) answers without a password, and jobs may run their own code "
            "(TRAINJOBS_ALLOW_ENTRYPOINTS):\n"
            "  any job that reaches it can push, reorder or drop queue entries of every other job.\n"
            "  Give Redis a password (requirepass, or an ACL user) and the service TRAINJOBS_REDIS_PASSWORD_FILE.",
            who, _without_credentials(settings.redis_url))
    return is_open


def _without_credentials(url: str) -> str:
    parsed = urlparse(url)
    netloc = parsed.netloc.rpartition("@")[2]
    return urlunparse(parsed._replace(netloc=netloc))
