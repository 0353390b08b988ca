"""A job's JSON as the API sends it, kept per API process by job id and row version: reading a job unchanged
since this process last rendered it loads no row and renders nothing.

Exact because every write to a job bumps its version (a trigger, migrations/versions/0011): a body is only
ever served for the version it was rendered from. Bounded: the least recently read jobs leave first.
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

from service.jobs.models import Job
from service.jobs.schemas import JobPublic

SIZE = 4096  # jobs (~1.5 kB each): a dashboard's pages and its pollers' jobs


class RenderedJobs:
    """job id → (version, the bytes of its JobPublic)."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self.entries: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, job_id: str, version: int) -> bytes | None:
        with self.lock:
            found = self.entries.get(job_id)
            if found is None or found[0] != version:
                return None
            self.entries.move_to_end(job_id)
            return found[1]

    def render(self, job: Job) -> bytes:
        """The job's body, rendered now and kept for its version."""
        body = JobPublic.of(job).model_dump_json().encode()
        with self.lock:
            self.entries[job.id] = (job.version, body)
            self.entries.move_to_end(job.id)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return body


def page_body(items: Iterable[bytes], next_cursor: str | None) -> bytes:
    """JobsPublic's JSON from its items' (the bytes pydantic writes: compact, in field order; a test pins it)."""
    return b'{"items":[' + b",".join(items) + b'],"next_cursor":' + json.dumps(next_cursor).encode() + b"}"
