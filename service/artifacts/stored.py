"""A job's artifacts as the API serves them from the object store (TRAINJOBS_STORAGE_URL; service/storage/).

Streamed through the API with HTTP Range (one range per request: a download manager resumes or splits a large
model with it), or, with TRAINJOBS_STORE_PRESIGNED_URLS on, a redirect to a presigned URL of the store: the bytes
then never pass through the API, and the client must reach the store itself.
"""

import re
from collections.abc import Iterator

from service.errors import ArtifactNotFound
from service.storage import ObjectInfo, Store, artifact_key
from trainjobs.errors import TrainjobsError

RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class RangeNotSatisfiable(TrainjobsError):
    """A Range outside the artifact: 416, with the size in Content-Range as RFC 9110 asks."""

    status_code = 416

    def __init__(self, size: int, asked: str):
        super().__init__(f"Range {asked!r} is outside the artifact's {size} bytes", field="Range")
        self.headers = {"Content-Range": f"bytes */{size}"}


def list_artifacts(store: Store, job_id: str) -> list[dict]:
    """Every object under the job's artifacts prefix, named by its path below it."""
    folder = artifact_key(job_id)
    return [{"name": o.key[len(folder):], "size": o.size, "modified": o.modified} for o in store.list(folder)]


def find_artifact(store: Store, job_id: str, name: str) -> tuple[str, ObjectInfo]:
    """The artifact's key, size and time; a name that would leave the job's prefix is refused (artifact_key)
    before the store is asked."""
    key = artifact_key(job_id, name)
    info = store.head(key)
    if info is None:
        raise ArtifactNotFound(f"job {job_id} has no artifact {name!r}", field="name")
    return key, info


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The first..last byte (inclusive) a Range header asks of `size` bytes; None: the whole (no header, another
    unit, or several ranges, which a server may answer whole); RangeNotSatisfiable when it asks none of them."""
    if not header:
        return None
    match = RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        raise RangeNotSatisfiable(size, header)
    if not first:  # bytes=-N: the last N
        if int(last) == 0:
            raise RangeNotSatisfiable(size, header)
        return max(0, size - int(last)), size - 1
    start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        raise RangeNotSatisfiable(size, header)
    return start, end


def read_artifact(store: Store, key: str, info: ObjectInfo, span: tuple[int, int] | None) -> Iterator[bytes]:
    # NOTE: the length served is the one read at head(); an artifact replaced meanwhile (a retry) ends it early.
    if info.size == 0:
        return iter(())
    start, end = span or (0, info.size - 1)
    return store.read(key, start, end)
