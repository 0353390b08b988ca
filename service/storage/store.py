"""The store's interface, its keys, and the directory implementation.

Every key is `jobs/<id>/...` below the store's own prefix, built here from a checked job id and checked parts:
a job's name, a checkpoint's folder or an artifact's path can never make one that leaves the job's prefix
(no `..`, no absolute path, no empty or dot part, no backslash or NUL).

An object is all or nothing: the directory writes a temporary file then renames it, S3 makes an object visible
only once its upload is whole. What a checkpoint consists of is said by its manifest, written last
(worker/store_sync.py), so a half-uploaded checkpoint is never the latest.
"""

import os
import secrets
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from trainjobs.errors import InvalidRequest, TrainjobsError
from trainjobs.paths import ARTIFACTS, CHECKPOINTS, is_job_id

MANIFESTS = "checkpoint-manifests"  # jobs/<id>/checkpoint-manifests/step_00000500.json: one per stored checkpoint
PARTS = "checkpoint-parts"  # jobs/<id>/checkpoint-parts/step_00000500/node_1.json: a gang's node's files of one
CHUNK = 1 << 16


class StoreUnavailable(TrainjobsError):
    """The store did not answer, or refused (no bucket, wrong credentials): an outage, a 503 to an API client."""

    status_code = 503
    headers = {"Retry-After": "5"}


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # below the store's prefix: jobs/<id>/...
    size: int
    modified: datetime  # UTC


def check_relative(path: str, *, what: str, field: str | None = None) -> list[str]:
    """The parts of a relative path that stays where it is put; InvalidRequest for any other."""
    parts = path.split("/")
    if (not path or "\0" in path or "\\" in path or path.startswith("/")
            or any(p in ("", ".", "..") for p in parts)):
        raise InvalidRequest(f"{what} {path!r} is not a path inside the job's folder", field=field)
    return parts


def job_prefix(job_id: str) -> str:
    if not is_job_id(job_id):
        raise InvalidRequest(f"{job_id!r} is not a job id", field="job_id")
    return f"jobs/{job_id}/"


def checkpoint_key(job_id: str, checkpoint: str = "", path: str = "") -> str:
    """The checkpoints' folder, a checkpoint's folder (`step_00000500`) or a file in it."""
    if not checkpoint:
        return f"{job_prefix(job_id)}{CHECKPOINTS}/"
    check_relative(checkpoint, what="checkpoint")
    key = f"{job_prefix(job_id)}{CHECKPOINTS}/{checkpoint}/"
    return key + "/".join(check_relative(path, what="checkpoint file")) if path else key


def manifest_key(job_id: str, checkpoint: str = "") -> str:
    """The manifests' folder, or one checkpoint's manifest."""
    folder = f"{job_prefix(job_id)}{MANIFESTS}/"
    return f"{folder}{'/'.join(check_relative(checkpoint, what='checkpoint'))}.json" if checkpoint else folder


def part_key(job_id: str, checkpoint: str = "", node_rank: int | None = None) -> str:
    """A gang's node parts: the folder of all, of one checkpoint's, or one node's part of it."""
    folder = f"{job_prefix(job_id)}{PARTS}/"
    if not checkpoint:
        return folder
    folder += "/".join(check_relative(checkpoint, what="checkpoint")) + "/"
    return folder if node_rank is None else f"{folder}node_{int(node_rank)}.json"


def package_key(digest: str) -> str:
    """An uploaded package's archive, by its digest (sha256:<hex>): `packages/<hex>.tar.gz`, shared by its owners."""
    hex_digest = digest.removeprefix("sha256:")
    if len(hex_digest) != 64 or any(c not in "0123456789abcdef" for c in hex_digest):
        raise InvalidRequest(f"{digest!r} is not a package digest", field="digest")
    return f"packages/{hex_digest}.tar.gz"


def artifact_key(job_id: str, name: str = "") -> str:
    """The artifacts' folder, or one artifact by its path relative to the job's artifacts."""
    folder = f"{job_prefix(job_id)}{ARTIFACTS}/"
    return folder + "/".join(check_relative(name, what="artifact name", field="name")) if name else folder


def disposition(filename: str) -> str:
    """Content-Disposition for a download of `filename` (RFC 6266: filename*= where it is not plain ASCII)."""
    return (f'attachment; filename="{filename}"' if quote(filename) == filename
            else f"attachment; filename*=utf-8''{quote(filename)}")


class Store(ABC):
    """What the worker and the API need of a store; keys are relative to the store's prefix."""

    url: str  # named in every error, so an operator knows which store is at fault

    @abstractmethod
    def check(self) -> None:
        """Reachable, there, and ours to read and write; StoreUnavailable saying why not."""

    @abstractmethod
    def put_file(self, key: str, file: BinaryIO) -> None:
        """The open file's bytes (from its position) as the object `key`, replacing any."""

    @abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """The object into a new file at `dest`; FileNotFoundError if there is none."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove the objects; one already gone is no error."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None if there is none."""

    @abstractmethod
    def read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes start..end (inclusive; None: to the end) of the object, in chunks; FileNotFoundError if none."""

    def presign(self, key: str, *, ttl_s: int, filename: str) -> str | None:
        """A URL that downloads the object (as `filename`) without credentials for ttl_s, or None where the store
        has no such URLs (a folder)."""
        return None

    def put_bytes(self, key: str, data: bytes) -> None:
        import io

        self.put_file(key, io.BytesIO(data))

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.read(key))

    def _check_key(self, key: str) -> str:
        check_relative(key, what="key")  # every key the store is handed, wherever it was made
        if not key.startswith(("jobs/", "packages/")):
            raise InvalidRequest(f"key {key!r} is outside the jobs' and the packages' prefixes")
        return key


class DirectoryStore(Store):
    """A folder as the store (`file:///mnt/store`): a mounted volume that only the workers and the API reach.

    Objects are written to `.uploads/` then renamed into place, so none is ever seen half-written.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def check(self) -> None:
        if not self.root.is_dir() or not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailable(f"the store {self.url} is not a folder this process can read and write")

    def _path(self, key: str) -> Path:
        return self.root / self._check_key(key)

    def put_file(self, key: str, file: BinaryIO) -> None:
        path = self._path(key)
        uploads = self.root / ".uploads"
        uploads.mkdir(exist_ok=True)
        tmp = uploads / secrets.token_hex(8)
        try:
            with open(tmp, "wb") as out:
                shutil.copyfileobj(file, out, CHUNK)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, dest: Path) -> None:
        shutil.copyfile(self._path(key), dest)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._check_key(prefix.rstrip("/"))
        top = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        found = []
        for folder, _, names in os.walk(top):  # os.walk follows no link into a folder
            for name in names:
                path = Path(folder, name)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not key.startswith(".uploads/") and not path.is_symlink():
                    info = path.stat()
                    found.append(ObjectInfo(key, info.st_size, datetime.fromtimestamp(info.st_mtime, UTC)))
        return sorted(found, key=lambda o: o.key)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        if not path.is_file() or path.is_symlink():
            return None
        info = path.stat()
        return ObjectInfo(key, info.st_size, datetime.fromtimestamp(info.st_mtime, UTC))

    def read(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        file = open(self._path(key), "rb")  # noqa: SIM115 - closed by the generator, however it ends
        return _chunks(file, start, end)


def _chunks(file: BinaryIO, start: int, end: int | None) -> Iterator[bytes]:
    with file:
        file.seek(start)
        left = None if end is None else end - start + 1
        while left is None or left > 0:
            chunk = file.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                return
            if left is not None:
                left -= len(chunk)
            yield chunk
