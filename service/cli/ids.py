"""A job as the user names it: its id, a unique prefix of it (4 characters or more), or its exact name.

Resolved here, through the API's list (the jobs the caller may see): ids are ordered, so the jobs whose id
starts with a prefix are the first page below the next prefix up (`cursor`), newest first; a name is the
list's `name` filter (a prefix) kept to the exact matches. Anything that names more than one job is refused,
listing them.

NOTE: ids are time-ordered (12 hex digits of milliseconds, then 8 random ones), so the jobs of one day share
their first 6 or 7 digits: a prefix that tells them apart is 10 or more characters long.
"""

from __future__ import annotations

import string
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainjobs.client import Client

JOB_ID_LEN = 20
MIN_PREFIX = 4
SHOWN = 10  # the candidates an ambiguous reference lists


class NoSuchJob(ValueError):
    """Nothing the caller may see matches the reference."""


class AmbiguousJob(ValueError):
    """The reference names several jobs: its message lists them."""


def is_hex(text: str) -> bool:
    return bool(text) and all(c in string.hexdigits.lower() for c in text)


def upper_bound(prefix: str) -> str | None:
    """The smallest full id above every id that starts with `prefix` (None: no id is above them)."""
    value = int(prefix, 16) + 1
    if value >= 16 ** len(prefix):
        return None
    return f"{value:0{len(prefix)}x}".ljust(JOB_ID_LEN, "0")


def by_prefix(client: Client, prefix: str) -> list[dict]:
    """The jobs whose id starts with `prefix`, newest first (at most SHOWN + 1)."""
    page = client.list(limit=SHOWN + 1, cursor=upper_bound(prefix))
    return [job for job in page["items"] if job["id"].startswith(prefix)]


def by_name(client: Client, name: str) -> list[dict]:
    """The jobs named exactly `name`, newest first (at most SHOWN + 1)."""
    return list(islice((job for job in client.iter_jobs(name=name) if job["name"] == name), SHOWN + 1))


def resolve(client: Client, ref: str) -> str:
    """The id of the one job `ref` names; NoSuchJob or AmbiguousJob (a ValueError: the CLI prints its message)."""
    if len(ref) == JOB_ID_LEN and is_hex(ref):
        return ref  # a whole id: asked of the API as it is (a 404 says if it is not there)
    found: dict[str, dict] = {}
    if len(ref) >= MIN_PREFIX and is_hex(ref):
        found.update((job["id"], job) for job in by_prefix(client, ref))
    found.update((job["id"], job) for job in by_name(client, ref))
    if len(found) == 1:
        return next(iter(found))
    if not found:
        short = f" (an id prefix needs {MIN_PREFIX} characters or more)" if is_hex(ref) and len(ref) < MIN_PREFIX \
            else ""
        raise NoSuchJob(f"no job matches {ref!r}{short}: give its id, a unique prefix of it or its exact name "
                        "(`trainjobs list` shows them)")
    jobs = sorted(found.values(), key=lambda job: job["id"], reverse=True)
    lines = [f"  {job['id']}  {job['status']:<9}  {job['created_at'][:19].replace('T', ' ')}  {job['name']}"
             for job in jobs[:SHOWN]]
    more = "\n  ... and more" if len(jobs) > SHOWN else ""
    raise AmbiguousJob(f"{ref!r} matches {'more than ' if more else ''}{min(len(jobs), SHOWN)} jobs; give more of "
                       "the id:\n" + "\n".join(lines) + more)
