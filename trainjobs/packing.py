"""Working-directory packages: pack a folder into a gzipped tar, and check and unpack one safely.

Pure standard library: the CLI and the SDK pack (`pack`), the API checks what it is sent and the worker checks
again before it unpacks (`check_archive`, `unpack`). A package is named by the sha256 of its bytes
("sha256:<hex>"); packing is deterministic (sorted members, no times, owners or umask in it), so the same
folder is the same package and is uploaded once.
"""

import fnmatch
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

IGNORE_FILE = ".trainjobsignore"
ALWAYS_LEFT_OUT = frozenset({".git", "__pycache__", ".venv", "trainjobs-data", "trainjobs-data-secrets"})
# Never packed whatever their name: a service's data dir or secrets dir (`trainjobs up` run in the folder being
# packed): its database, its admin token, earlier jobs' runs and packages would go into the job.
SERVICE_MARKERS = ("admin.token", "trainjobs.db")
SERVICE_FILES = frozenset({"admin.token", "trainjobs.db", "trainjobs.db-wal", "trainjobs.db-shm"})
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 1 << 20


class UnsafeArchive(ValueError):
    """An archive that would write outside its folder, or more than the limits allow; names the member."""

    def __init__(self, message: str, member: str | None = None):
        super().__init__(message)
        self.member = member


@dataclass(frozen=True)
class Packed:
    path: Path  # the .tar.gz, a temporary file while `pack`'s block runs
    digest: str  # "sha256:<hex>" of its bytes
    size: int  # bytes of the .tar.gz
    files: int  # members (files, folders and links)


@dataclass(frozen=True)
class ArchiveInfo:
    files: int
    unpacked_bytes: int


# --- packing -----------------------------------------------------------------------------------------------------

class Ignore:
    """The subset of .gitignore a project needs: globs (`*`, `?`, `[...]`, `**/`), a trailing `/` for folders
    only, a leading (or inner) `/` anchoring to the root, `!` to take a path back, `#` comments."""

    def __init__(self, lines: list[str]):
        self.rules: list[tuple[bool, bool, bool, str]] = []  # (negate, dir_only, anchored, pattern)
        for raw in lines:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            self.rules.append((negate, dir_only, anchored, line.lstrip("/")))

    @classmethod
    def of(cls, folder: Path) -> "Ignore":
        path = folder / IGNORE_FILE
        return cls(path.read_text().splitlines() if path.is_file() else [])

    def ignored(self, relative: str, is_dir: bool) -> bool:
        verdict = False
        name = relative.rsplit("/", 1)[-1]
        for negate, dir_only, anchored, pattern in self.rules:
            if dir_only and not is_dir:
                continue
            if anchored:
                hit = fnmatch.fnmatchcase(relative, pattern) or (
                    pattern.startswith("**/") and fnmatch.fnmatchcase(relative, pattern[3:]))
            else:
                hit = fnmatch.fnmatchcase(name, pattern)
            if hit:
                verdict = not negate
        return verdict


def service_dir(folder: Path) -> bool:
    """A trainjobs data dir or secrets dir (its database, its admin token, or runs/ beside storage/)."""
    return (any((folder / m).is_file() for m in SERVICE_MARKERS)
            or ((folder / "runs").is_dir() and (folder / "storage").is_dir()))


def walk(folder: Path) -> Iterator[tuple[str, Path]]:
    """(archive name, path) of what a package of `folder` holds, sorted; ignored folders are not entered."""
    ignore = Ignore.of(folder)

    def visit(directory: Path, prefix: str) -> Iterator[tuple[str, Path]]:
        for entry in sorted(directory.iterdir(), key=lambda p: p.name):
            relative = f"{prefix}{entry.name}"
            is_dir = entry.is_dir() and not entry.is_symlink()
            if entry.name in ALWAYS_LEFT_OUT or ignore.ignored(relative, is_dir):
                continue
            if (entry.name in SERVICE_FILES and not is_dir) or (is_dir and service_dir(entry)):
                continue
            yield relative, entry
            if is_dir:
                yield from visit(entry, relative + "/")

    yield from visit(folder, "")


def _tarinfo(tar: tarfile.TarFile, path: Path, name: str, root: Path) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname=name)
    if info.issym():
        target = (path.parent / os.readlink(path)).resolve()
        if os.path.isabs(info.linkname) or not target.is_relative_to(root):
            raise UnsafeArchive(f"{name} is a link to {info.linkname}, outside the folder", name)
    elif not (info.isfile() or info.isdir()):
        raise UnsafeArchive(f"{name} is neither a file, a folder nor a link", name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    executable = info.mode & stat.S_IXUSR
    info.mode = 0o755 if (info.isdir() or executable) else 0o644
    return info


@contextmanager
def pack(folder: str | os.PathLike) -> Iterator[Packed]:
    """Pack `folder` into a temporary .tar.gz (removed when the block ends); the same files give the same digest."""
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ValueError(f"{folder} is not a folder")
    handle, name = tempfile.mkstemp(prefix="trainjobs-package-", suffix=".tar.gz")
    os.close(handle)
    path = Path(name)
    try:
        files = 0
        with open(path, "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="", compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for relative, entry in walk(root):
                info = _tarinfo(tar, entry, relative, root)
                if info.isfile():
                    with open(entry, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
                files += 1
        yield Packed(path=path, digest=file_digest(path), size=path.stat().st_size, files=files)
    finally:
        path.unlink(missing_ok=True)


def fingerprint(folder: str | os.PathLike) -> str:
    """What the package of `folder` would hold, by name, size, mode and modification time (no file is read):
    the key of the client's digest cache, so an unchanged folder is not packed again to learn its digest."""
    root = Path(folder).resolve()
    h = hashlib.sha256(str(root).encode())
    for relative, entry in walk(root):
        st = entry.lstat()
        h.update(f"{relative}\0{st.st_size}\0{st.st_mode}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _digest_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainjobs" / "package-digests.json"


def known_digest(key: str) -> str | None:
    """The digest this machine packed last for a folder with this fingerprint, if any."""
    try:
        digest = json.loads(_digest_cache().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) and DIGEST.match(digest) else None


def remember_digest(key: str, digest: str, keep: int = 256) -> None:
    """Note a folder's digest (the newest `keep` folders); a cache that cannot be written is no error."""
    path = _digest_cache()
    try:
        try:
            known = json.loads(path.read_text())
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known.pop(key, None)
        known[key] = digest
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        temp.write_text(json.dumps(dict(list(known.items())[-keep:])))
        os.replace(temp, path)
    except OSError:
        pass


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


# --- checking and unpacking --------------------------------------------------------------------------------------

def _inside(name: str) -> str | None:
    """The member's normalized relative path, or None when it is absolute or climbs out with `..`."""
    if not name or "\0" in name or name.startswith("/") or "\\" in name:
        return None
    parts = PurePosixPath(name).parts
    if ".." in parts or (parts and parts[0].endswith(":")):
        return None
    return "/".join(p for p in parts if p != ".")


def check_archive(fileobj: BinaryIO, *, max_files: int, max_unpacked_bytes: int) -> ArchiveInfo:
    """Walk the members' headers (nothing is written): refuse, naming the member, an absolute path, `..`, a link
    whose target leaves the folder, a device or pipe, more than `max_files` members, or more than
    `max_unpacked_bytes` in all. The sizes come from the headers, so a bomb is refused at its header."""
    files = total = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r|gz") as tar:
            for member in tar:
                files += 1
                if files > max_files:
                    raise UnsafeArchive(f"the package holds more than {max_files} files "
                                        "(TRAINJOBS_MAX_PACKAGE_FILES)", member.name)
                name = _inside(member.name)
                if name is None:
                    raise UnsafeArchive(f"member {member.name!r} is an absolute path or leaves the folder", member.name)
                if member.issym():
                    target = _inside(str(PurePosixPath(name).parent / member.linkname)) \
                        if not member.linkname.startswith("/") else None
                    if target is None:
                        raise UnsafeArchive(f"member {member.name!r} is a link to {member.linkname!r}, outside the "
                                            "folder", member.name)
                elif member.islnk():
                    if _inside(member.linkname) is None:
                        raise UnsafeArchive(f"member {member.name!r} is a hard link to {member.linkname!r}, outside "
                                            "the folder", member.name)
                elif not (member.isfile() or member.isdir()):
                    raise UnsafeArchive(f"member {member.name!r} is a device, pipe or other special file",
                                        member.name)
                total += max(0, member.size)
                if total > max_unpacked_bytes:
                    raise UnsafeArchive(f"the package unpacks to more than {max_unpacked_bytes} bytes "
                                        f"(TRAINJOBS_MAX_PACKAGE_UNPACKED_BYTES; {member.name!r} alone is "
                                        f"{member.size})", member.name)
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as exc:
        raise UnsafeArchive(f"not a gzipped tar archive ({type(exc).__name__}: {exc})") from exc
    return ArchiveInfo(files=files, unpacked_bytes=total)


def unpack(archive: str | os.PathLike, dest: str | os.PathLike, *, max_files: int, max_unpacked_bytes: int) -> None:
    """Check `archive` again, then extract it into the new folder `dest` (tarfile's `data` filter as well)."""
    with open(archive, "rb") as f:
        check_archive(f, max_files=max_files, max_unpacked_bytes=max_unpacked_bytes)
    dest = Path(dest)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
