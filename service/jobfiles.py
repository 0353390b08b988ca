"""The one way the host reaches a job's files (DESIGN.md rule 6): from its folder's descriptor, no link followed.

A job's ranks write its run dir, checkpoints and artifacts as a uid of their own, and the service (a root worker,
the API) reads, uploads, lends and mounts what they wrote. Any name in those folders may be a link the job planted
to make root open something else (the SQLite file, another job's checkpoint), a FIFO that blocks root's open()
for ever, a device, or a hard link to a file the job may not read. So every open goes through here:

- relative to a descriptor of a folder the service made (`open_folder`), with openat2's RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS where the kernel has it (Linux 5.6), else one name at a time with
  O_NOFOLLOW; `..` and absolute names refused either way;
- O_NONBLOCK, then fstat: a regular file or a folder only (a FIFO's open does not wait for a writer);
- a file with a second name (st_nlink > 1) or, where `owners` is given, an owner other than the job's uid or the
  service's own, is refused;
- what is lent to a sandbox is mounted from the checked descriptor (bwrap's --ro-bind-fd), never by name again.

A refusal is `Refused`, whose message names the file and what it is ("model.pt is a link"): the job's error.
"""

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE = 0x02 | 0x04 | 0x08  # RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
_BASE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FOLDER = _BASE | os.O_DIRECTORY


class Refused(OSError):
    """A job's file the host will not touch: a link, a FIFO, a device, a hard link, or not the job's."""

    def __init__(self, name: str, what: str):
        super().__init__(errno.EPERM, f"{name} {what}")
        self.name, self.what = name, what

    def __str__(self) -> str:
        return f"{self.name} {self.what}"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_has_openat2: bool | None = None if _SYS_OPENAT2 else False


def _openat2(dir_fd: int, rel: str, flags: int) -> int | None:
    """openat2(2) beneath dir_fd with no link at any part; None where the kernel lacks it."""
    global _has_openat2
    if _has_openat2 is False:
        return None
    how = _OpenHow(flags, 0, _RESOLVE)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        _has_openat2 = True
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and _has_openat2 is None:  # no openat2, or a seccomp filter forbids it
        _has_openat2 = False
        return None
    raise OSError(err, os.strerror(err), rel)


def _walk(dir_fd: int, parts: tuple[str, ...], flags: int) -> int:
    """The fallback: one name at a time, each opened with O_NOFOLLOW from the folder above it."""
    fd = dir_fd
    try:
        for part in parts[:-1]:
            try:
                below = os.open(part, _FOLDER, dir_fd=fd)
            except NotADirectoryError:  # O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR: name it a link
                if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise OSError(errno.ELOOP, "a link", part) from None
                raise
            if fd != dir_fd:
                os.close(fd)
            fd = below
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def _parts(rel: str | os.PathLike) -> tuple[str, ...]:
    path = PurePosixPath(os.fspath(rel))
    parts = tuple(p for p in path.parts if p != ".")
    if path.is_absolute() or ".." in parts:
        raise Refused(str(rel), "is not a name inside the job's folder")
    return parts


def open_folder(path: Path) -> int:
    """A folder the service made (the run dir, the job's storage folder): its own name must not be a link."""
    return os.open(path, _FOLDER)


def open_beneath(dir_fd: int, rel: str | os.PathLike, *, folder: bool = False,
                 owners: Collection[int] | None = None) -> int:
    """A descriptor of `rel` under dir_fd, checked (see the module's doc); Refused, or FileNotFoundError."""
    parts = _parts(rel)
    if not parts:
        return os.dup(dir_fd)
    name, flags = "/".join(parts), _FOLDER if folder else _BASE
    try:
        fd = _openat2(dir_fd, name, flags)
        if fd is None:
            fd = _walk(dir_fd, parts, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):  # a link at some part (openat2 says EXDEV for an escape)
            raise Refused(name, "is a link") from None
        if exc.errno == errno.ENXIO:  # a socket
            raise Refused(name, "is a socket") from None
        if exc.errno == errno.ENOTDIR and folder:  # O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR too
            os.close(open_beneath(dir_fd, rel, owners=owners))  # without O_DIRECTORY: Refused names a link
            raise Refused(name, "is not a folder") from None
        if exc.errno == errno.ENOTDIR:
            raise Refused(name, "lies under something that is not a folder") from None
        raise
    try:
        _check(fd, name, owners)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(fd: int, name: str, owners: Collection[int] | None) -> None:
    info = os.fstat(fd)
    mode = info.st_mode
    if stat.S_ISFIFO(mode):
        raise Refused(name, "is a FIFO")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise Refused(name, "is a device")
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise Refused(name, "is not a regular file")
    if stat.S_ISREG(mode) and info.st_nlink > 1:
        raise Refused(name, "has another name (a hard link)")
    if owners is not None and info.st_uid not in owners:
        raise Refused(name, f"belongs to uid {info.st_uid}, not to the job")


def owners_of(job_uid: int | None) -> set[int]:
    """Whose files the host reads in a job's folders: the job's uid (a root worker's sandbox) and its own."""
    return {os.geteuid()} if job_uid is None else {job_uid, os.geteuid()}


@contextmanager
def opened(folder: Path, rel: str | os.PathLike, *, owners: Collection[int] | None = None) -> Iterator[BinaryIO]:
    """`rel` under `folder` as a binary file object (a regular file only)."""
    top = open_folder(folder)
    try:
        fd = open_beneath(top, rel, owners=owners)
    finally:
        os.close(top)
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(os.fspath(rel), "is a folder")
    with os.fdopen(fd, "rb") as file:
        yield file


def read_bytes(folder: Path, rel: str | os.PathLike, *, limit: int, offset: int = 0,
               owners: Collection[int] | None = None) -> tuple[bytes, int]:
    """At most `limit` bytes of `rel` from `offset`, and the file's size when it was opened."""
    with opened(folder, rel, owners=owners) as file:
        size = os.fstat(file.fileno()).st_size
        file.seek(offset)
        return file.read(limit), size


def find(folder: Path, rel: str | os.PathLike, name: str, *, limit: int = 4096) -> list[PurePosixPath]:
    """Every entry called `name` under folder/rel (its path relative to `folder`), walked from descriptors with no
    link followed, at most `limit` of them; [] where rel is missing or not a real folder."""
    try:
        top = open_folder(folder)
    except OSError:
        return []
    try:
        start = open_beneath(top, rel, folder=True)
    except OSError:
        return []
    finally:
        os.close(top)
    found: list[PurePosixPath] = []
    try:
        for where, dirs, files, _ in os.fwalk(".", dir_fd=start, follow_symlinks=False):
            found += [PurePosixPath(rel, where, name) for entry in (*dirs, *files) if entry == name]
            if len(found) >= limit:
                break
    finally:
        os.close(start)
    return found[:limit]


def staging(storage_dir: Path) -> Path:
    """Where the service stages what it will put in a job's folder (a download): its own, never shown to a job.

    NOTE: never inside the job's folder, where a link the job planted at the staging name would take root's write
    anywhere; the same filesystem as the job's folders, so `place` is one rename."""
    folder = storage_dir / ".staging"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def place(source: Path, folder: Path, name: str) -> None:
    """Move the service's own `source` (a file or a folder) to folder/name, replacing whatever the job left there
    (a link is removed, not followed); `folder` is reached by descriptor, so a swapped parent takes nothing."""
    parts = _parts(name)
    if len(parts) != 1:
        raise Refused(name, "is not one name")
    top = open_folder(folder)
    try:
        try:
            there = os.lstat(name, dir_fd=top)
        except FileNotFoundError:
            there = None
        if there is not None and stat.S_ISDIR(there.st_mode):
            shutil.rmtree(name, dir_fd=top)  # fd-based: follows no link inside
        elif there is not None:
            os.unlink(name, dir_fd=top)
        os.rename(source, name, dst_dir_fd=top)
    finally:
        os.close(top)


def is_real(folder: Path, rel: str | os.PathLike, *, kind: str = "file") -> bool:
    """Whether `rel` under `folder` is a real "file" or "folder": a link, a FIFO or a device is neither."""
    try:
        top = open_folder(folder)
    except OSError:
        return False
    try:
        fd = open_beneath(top, rel, folder=kind == "folder")
    except OSError:  # Refused too
        return False
    finally:
        os.close(top)
    try:
        return stat.S_ISDIR(os.fstat(fd).st_mode) == (kind == "folder")
    finally:
        os.close(fd)
