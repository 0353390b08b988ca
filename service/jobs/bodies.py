"""A job's JSON as the API sends it, kept per API process by job id and row version: reading a job unchanged
since this process last rendered it loads no row and renders nothing.

Exact because every write to a job bumps its version (a trigger, migrations/versions/0011): a body is only
ever served for the version it was rendered from. Bounded: the least recently read jobs leave first.
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

from service.jobs.models import Job
from service.jobs.schemas import JobPublic

K = TypeVar("K")
SIZE = 4096  # jobs (~1.5 kB each): a dashboard's pages and its pollers' jobs


class Kept(Generic[K]):
    """key → (version, bytes), the least recently read leaving first past `size`; shared by the API's threads."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[K, tuple[int, bytes]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: K, version: int) -> bytes | None:
        """The bytes kept for key, if they were kept for this version."""
        with self.lock:
            found = self.entries.get(key)
            if found is None or found[0] != version:
                return None
            self.entries.move_to_end(key)
            return found[1]

    def put(self, key: K, version: int, body: bytes) -> None:
        with self.lock:
            self.entries[key] = (version, body)
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)


class RenderedJobs(Kept[str]):
    """job id → (version, the bytes of its JobPublic)."""

    def __init__(self, size: int = SIZE):
        super().__init__(size)

    def render(self, job: Job) -> bytes:
        """The job's body, rendered now and kept for its version."""
        body = JobPublic.of(job).model_dump_json().encode()
        self.put(job.id, job.version, body)
        return body


def page_body(items: Iterable[bytes], next_cursor: str | None) -> bytes:
    """JobsPublic's JSON from its items' (the bytes pydantic writes: compact, in field order; a test pins it)."""
    return b'{"items":[' + b",".join(items) + b'],"next_cursor":' + json.dumps(next_cursor).encode() + b"}"
