"""A job (or a sweep) as the user names it: its id, a unique prefix of it (4 characters or more), or its exact name.

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


SWEEPS_SEARCHED = 200  # the newest sweeps an exact name is looked for among (the API's largest page)


def sweeps_by_prefix(client: Client, prefix: str) -> list[dict]:
    page = client.sweeps(limit=SHOWN + 1, cursor=upper_bound(prefix))
    return [sweep for sweep in page["items"] if sweep["id"].startswith(prefix)]


def sweeps_by_name(client: Client, name: str) -> list[dict]:
    return [sweep for sweep in client.sweeps(limit=SWEEPS_SEARCHED)["items"] if sweep["name"] == name][:SHOWN + 1]


def resolve(client: Client, ref: str) -> str:
    """The id of the one job `ref` names; NoSuchJob or AmbiguousJob (a ValueError: the CLI prints its message)."""
    return find(ref, by_prefix=lambda p: by_prefix(client, p), by_name=lambda n: by_name(client, n), kind="job",
                lister="trainjobs list")


def resolve_sweep(client: Client, ref: str) -> str:
    """The id of the one sweep `ref` names (among the newest SWEEPS_SEARCHED, by name), as resolve does for jobs."""
    return find(ref, by_prefix=lambda p: sweeps_by_prefix(client, p), by_name=lambda n: sweeps_by_name(client, n),
                kind="sweep", lister="trainjobs sweeps")


def find(ref: str, *, by_prefix, by_name, kind: str, lister: str) -> str:
    if len(ref) == JOB_ID_LEN and is_hex(ref):
        return ref  # a whole id: asked of the API as it is (a 404 says if it is not there)
    found: dict[str, dict] = {}
    if len(ref) >= MIN_PREFIX and is_hex(ref):
        found.update((row["id"], row) for row in by_prefix(ref))
    found.update((row["id"], row) for row in by_name(ref))
    if len(found) == 1:
        return next(iter(found))
    if not found:
        short = f" (an id prefix needs {MIN_PREFIX} characters or more)" if is_hex(ref) and len(ref) < MIN_PREFIX \
            else ""
        raise NoSuchJob(f"no {kind} matches {ref!r}{short}: give its id, a unique prefix of it or its exact name "
                        f"(`{lister}` shows them)")
    rows = sorted(found.values(), key=lambda row: row["id"], reverse=True)
    lines = [f"  {row['id']}  {row['status']:<9}  {row['created_at'][:19].replace('T', ' ')}  {row['name']}"
             for row in rows[:SHOWN]]
    more = "\n  ... and more" if len(rows) > SHOWN else ""
    raise AmbiguousJob(f"{ref!r} matches {'more than ' if more else ''}{min(len(rows), SHOWN)} {kind}s; give more "
                       "of the id:\n" + "\n".join(lines) + more)
