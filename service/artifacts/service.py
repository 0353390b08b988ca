"""A job's files as the API serves them: its artifacts folder (trainjobs/paths.py says where it is).

NOTE: a running job writes into its own folder with the uid of its worker, so it can put a link anywhere in
it, or swap a folder for a link between a check and a read (TRAINJOBS_ARTIFACTS_DIR -> /). Nothing here
follows a link: a path is opened as service/jobfiles.py opens every job's file (from the job's folder, no link
at any part, no FIFO), and what is served is the file that was opened and checked, never its name again.
"""

import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from service import jobfiles
from service.errors import ArtifactNotFound, InvalidRequest
from service.settings import Settings
from trainjobs.paths import ARTIFACTS, CHECKPOINTS, job_dir

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def checkpoint_dir(settings: Settings, job_id: str) -> Path:
    return job_dir(settings.resolved_storage_dir, job_id) / CHECKPOINTS


def artifacts_dir(settings: Settings, job_id: str) -> Path:
    return job_dir(settings.resolved_storage_dir, job_id) / ARTIFACTS


def open_artifact(settings: Settings, job_id: str, name: str) -> tuple[BinaryIO, os.stat_result]:
    """An artifact by its name relative to the job's artifacts folder, open: a regular file inside it, no link."""
    parts = name.replace("\\", "/").split("/")
    if not name or "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(f"artifact name {name!r} is not a file name inside the job's artifacts", field="name")
    missing = ArtifactNotFound(f"job {job_id} has no artifact {name!r}", field="name")
    try:
        top = jobfiles.open_folder(job_dir(settings.resolved_storage_dir, job_id))
    except OSError:
        raise missing from None
    try:
        folder = jobfiles.open_beneath(top, ARTIFACTS, folder=True)  # the job's folder itself swapped: none
    except OSError:
        raise missing from None
    finally:
        os.close(top)
    try:
        fd = jobfiles.open_beneath(folder, PurePosixPath(*parts))
    except jobfiles.Refused as exc:
        if exc.what == "is a link":
            raise InvalidRequest(f"artifact name {name!r} goes through a link; links are not served",
                                 field="name") from None
        raise missing from None
    except OSError:
        raise missing from None
    finally:
        os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise missing
    file = os.fdopen(fd, "rb")
    return file, info


def read_chunks(file: BinaryIO, length: int, size: int = 1 << 16) -> Iterator[bytes]:
    """The open file's first `length` bytes (what Content-Length promised, if a job is still writing it),
    closing it at the end or when the response is dropped."""
    with file:
        while length > 0 and (chunk := file.read(min(size, length))):
            length -= len(chunk)
            yield chunk


def list_artifacts(settings: Settings, job_id: str) -> list[dict]:
    """Every regular file under the job's artifacts folder; links (to files or folders) are left out."""
    fd = _open_artifacts_dir(settings, job_id)
    if fd is None:
        return []
    files = []
    try:
        # fwalk with follow_symlinks=False descends through file descriptors and never into a link.
        for folder, _, names, folder_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in names:
                try:
                    info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                if stat.S_ISREG(info.st_mode):
                    files.append({"name": Path(folder, name).as_posix(), "size": info.st_size,
                                  "modified": datetime.fromtimestamp(info.st_mtime, UTC)})
    finally:
        os.close(fd)
    return sorted(files, key=lambda f: f["name"])


def _open_artifacts_dir(settings: Settings, job_id: str) -> int | None:
    """The job's artifacts folder, reached from the storage folder without a link; None if there is none."""
    storage = settings.resolved_storage_dir
    try:
        fd = os.open(storage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's folder: may be a link
    except OSError:
        return None
    for part in artifacts_dir(settings, job_id).relative_to(storage).parts:
        try:
            found = os.open(part, _DIR, dir_fd=fd)
        except OSError:
            found = None
        os.close(fd)
        if found is None:
            return None
        fd = found
    return fd


