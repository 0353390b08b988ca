"""Packages in the object store (TRAINJOBS_STORAGE_URL), so a worker that shares no folder with the API runs them.

The API puts each package it keeps at `packages/<hex>.tar.gz` in the store, before the row that lets a spec name
it is committed, and deletes it with the last row. A worker whose local storage dir lacks a job's package fetches
it beside its place, checks that its sha256 is the digest it is named by (a store is trusted no more than a
disk), and renames it into place: the local copy is then this machine's cache, unpacked once by worker/packages.py.
"""

import hashlib
import logging
import os
from pathlib import Path

from service.settings import Settings
from service.storage import StoreUnavailable, open_store
from service.storage.store import package_key

log = logging.getLogger(__name__)
CHUNK = 1 << 20


def keep(settings: Settings, digest: str, archive: Path) -> None:
    """Put the checked archive into the store (no-op without one); StoreUnavailable: a 503, nothing committed."""
    if (store := open_store(settings)) is None:
        return
    key = package_key(digest)
    if (got := store.head(key)) is not None and got.size == archive.stat().st_size:
        return  # another owner's upload of the same bytes
    with open(archive, "rb") as file:
        store.put_file(key, file)


def forget(settings: Settings, digest: str) -> None:
    if (store := open_store(settings)) is not None:
        store.delete([package_key(digest)])


def fetch(settings: Settings, digest: str, dest: Path) -> bool:
    """The package into `dest` from the store when this machine lacks it; False without a store or when the store
    has none (the caller says the package is unavailable). StoreUnavailable when it does not answer, or gave
    bytes whose digest is another."""
    if dest.is_file():
        return True
    if (store := open_store(settings)) is None:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.with_name(f".fetch-{dest.name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        try:
            store.get_file(package_key(digest), temp)
        except FileNotFoundError:
            return False
        sha = hashlib.sha256()
        with open(temp, "rb") as file:
            while chunk := file.read(CHUNK):
                sha.update(chunk)
        if f"sha256:{sha.hexdigest()}" != digest:
            raise StoreUnavailable(f"the store {store.url} gave package {digest} with another digest, "
                                   f"sha256:{sha.hexdigest()}: refused")
        os.replace(temp, dest)  # atomic: a racing attempt of the same package finds it whole or not at all
    finally:
        temp.unlink(missing_ok=True)
    log.info("package %s fetched from %s", digest, store.url)
    return True
