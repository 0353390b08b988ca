"""A worker's cache of unpacked packages, and each attempt's own copy of one.

The cache is <data_dir>/package-cache/<hex>/, unpacked once per machine: into a temporary folder beside it
(after trainjobs.packing checks the archive again), then renamed into place, so two jobs racing for the same
package never see half a folder (the loser drops its copy). Each entry's last use is the mtime of <hex>.used,
its size is in <hex>.bytes; past TRAINJOBS_PACKAGE_CACHE_BYTES the least recently used entries go, but never one
used in the last EVICT_GRACE_S (an attempt may be copying it). An attempt runs in its own copy (the script may
write next to itself), so evicting an entry never touches a running job.
"""

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from trainjobs.packing import UnsafeArchive, unpack

log = logging.getLogger(__name__)
EVICT_GRACE_S = 300.0


class PackageUnavailable(Exception):
    pass


class PackageCache:
    def __init__(self, root: Path, *, max_bytes: int, max_files: int, max_unpacked_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        self.limits = {"max_files": max_files, "max_unpacked_bytes": max_unpacked_bytes}

    def get(self, digest: str, archive: Path) -> Path:
        """The unpacked package (unpacking it if this machine has not yet); marks it used."""
        name = digest.removeprefix("sha256:")
        final = self.root / name
        if not final.is_dir():
            if not archive.is_file():
                raise PackageUnavailable(f"package {digest} is not in the storage folder ({archive}): deleted, or "
                                         "this worker does not share the API's TRAINJOBS_STORAGE_DIR")
            self.root.mkdir(parents=True, exist_ok=True)
            temp = self.root / f".unpack-{name}-{os.getpid()}-{os.urandom(4).hex()}"
            started = time.monotonic()
            unpack(archive, temp, **self.limits)  # UnsafeArchive: the caller fails the job
            size = sum(p.stat().st_size for p in temp.rglob("*") if p.is_file() and not p.is_symlink())
            (self.root / f"{name}.bytes").write_text(str(size))
            try:
                os.rename(temp, final)  # atomic; fails if another attempt's rename won the race
                log.info("package %s unpacked into the cache in %.2fs", digest, time.monotonic() - started)
            except OSError:
                shutil.rmtree(temp, ignore_errors=True)
        (self.root / f"{name}.used").touch()
        self.evict(keep=name)
        return final

    def evict(self, keep: str | None = None) -> list[str]:
        """Drop the least recently used entries until the cache fits its limit; returns what went."""
        gone = evict_lru(self.root, max_bytes=self.max_bytes, keep=keep, remove=self._remove)
        if gone:
            log.info("package cache over %d bytes: evicted %s", self.max_bytes, gone)
        return gone

    def _remove(self, name: str) -> bool:
        doomed = self.root / f".evict-{name}-{os.urandom(4).hex()}"
        try:
            os.rename(self.root / name, doomed)  # out of sight at once, then removed
        except OSError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True


def evict_lru(root: Path, *, max_bytes: int, keep: str | None, remove: Callable[[str], bool]) -> list[str]:
    """A cache folder of <name>/ entries, each with <name>.used (its mtime: the last use) and <name>.bytes (its
    size): remove(name) the least recently used until the total fits max_bytes, never `keep` nor one used in
    the last EVICT_GRACE_S; remove() says False for one it may not remove now. Returns the names removed."""
    entries = []
    for used in root.glob("*.used"):
        name = used.name.removesuffix(".used")
        try:
            entries.append((used.stat().st_mtime, name, int((root / f"{name}.bytes").read_text())))
        except (OSError, ValueError):
            continue
    total, now, gone = sum(e[2] for e in entries), time.time(), []
    for mtime, name, size in sorted(entries):
        if total <= max_bytes:
            break
        if name == keep or now - mtime < EVICT_GRACE_S or not remove(name):
            continue
        for suffix in (".used", ".bytes"):
            (root / f"{name}{suffix}").unlink(missing_ok=True)
        total -= size
        gone.append(name)
    return gone


def materialize(cache: PackageCache, *, digest: str, archive: Path, dest: Path) -> None:
    """The attempt's own copy of the package at `dest` (a new folder)."""
    source = cache.get(digest, archive)
    shutil.copytree(source, dest, symlinks=True)


__all__ = ["PackageCache", "PackageUnavailable", "UnsafeArchive", "materialize"]
