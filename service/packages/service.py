"""Packages as the API stores them: one .tar.gz per digest under the storage folder, one row per owner.

The file lives at TRAINJOBS_STORAGE_DIR/packages/<hex>.tar.gz, where workers read it (the storage folder is
shared with them, as checkpoints are); it is written once, checked before it is kept, and renamed into place,
so no reader sees half a file. Who may use it is the `packages` rows: an owner sees only theirs (a 404 as for
jobs), and the file goes when the last row that names it goes.
"""

import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import InvalidRequest, NotFound, TrainjobsError
from service.packages import stored
from service.packages.models import Package
from service.settings import Settings
from trainjobs.packing import DIGEST, UnsafeArchive, check_archive


class PackageNotFound(NotFound):
    def __init__(self, digest: str, field: str = "digest"):
        super().__init__(f"package {digest!r} not found", field=field)


class TooLarge(TrainjobsError):
    status_code = 413


def check_digest(digest: str, field: str = "digest") -> str:
    if not DIGEST.match(digest):
        raise InvalidRequest(f"{digest!r} is not a package name: sha256:<64 lowercase hex digits>", field=field)
    return digest


def packages_dir(settings: Settings) -> Path:
    return settings.resolved_storage_dir / "packages"


def package_file(storage_dir: Path, digest: str) -> Path:
    """Where a package's .tar.gz is kept (the worker reads it from there)."""
    return storage_dir / "packages" / f"{check_digest(digest).removeprefix('sha256:')}.tar.gz"


def find(db: Session, *, owner: str | None, digest: str) -> Package | None:
    """The package if `owner` has it (None: an admin, who sees anyone's)."""
    query = select(Package).where(Package.digest == digest)
    if owner is not None:
        query = query.where(Package.owner == owner)
    return db.scalars(query.limit(1)).first()


def get(db: Session, *, owner: str | None, digest: str, field: str = "digest") -> Package:
    check_digest(digest, field)
    if (package := find(db, owner=owner, digest=digest)) is None:
        raise PackageNotFound(digest, field)
    return package


def listing(db: Session, *, owner: str) -> list[Package]:
    return list(db.scalars(select(Package).where(Package.owner == owner).order_by(Package.created_at)))


@dataclass(frozen=True)
class Received:
    path: Path  # the temporary file, checked
    size: int
    files: int
    unpacked_bytes: int


async def receive(chunks: AsyncIterator[bytes], *, settings: Settings, digest: str, declared: int | None) -> Received:
    """Stream the body to a temporary file beside the packages, hashing as it goes; refuse (removing it) a body
    over the cap (413, before reading it when its length says so), another hash (422) or an unsafe member (422
    naming it). Never holds the body in memory."""
    limit = settings.max_package_bytes
    if declared is not None and declared > limit:
        raise TooLarge(f"the package is {declared} bytes; at most {limit} (TRAINJOBS_MAX_PACKAGE_BYTES)", field="body")
    folder = packages_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    temp = folder / f".upload-{os.getpid()}-{os.urandom(8).hex()}"
    try:
        h, size = hashlib.sha256(), 0
        with open(temp, "wb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TooLarge(f"the package is over {limit} bytes (TRAINJOBS_MAX_PACKAGE_BYTES)", field="body")
                h.update(chunk)
                out.write(chunk)
        if f"sha256:{h.hexdigest()}" != digest:
            raise InvalidRequest(f"the body's sha256 is {h.hexdigest()}, not the {digest} it was sent as",
                                 field="digest")
        with open(temp, "rb") as f:
            try:
                info = check_archive(f, max_files=settings.max_package_files,
                                     max_unpacked_bytes=settings.max_package_unpacked_bytes)
            except UnsafeArchive as exc:
                raise InvalidRequest(str(exc), field="body") from exc
        return Received(path=temp, size=size, files=info.files, unpacked_bytes=info.unpacked_bytes)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def store(db: Session, *, settings: Settings, owner: str, digest: str, received: Received) -> tuple[Package, bool]:
    """Keep a checked upload for `owner` (within their quota): (the package, whether it is new to them).

    Two uploads of one folder at once (`trainjobs run` twice) both find no row: the primary key (owner, digest)
    decides, and the loser answers with the winner's package, as a second upload after the first would.
    """
    try:
        if (package := find(db, owner=owner, digest=digest)) is not None:
            return package, False
        used = db.scalar(select(func.coalesce(func.sum(Package.size), 0)).where(Package.owner == owner))
        if used + received.size > settings.quota_package_bytes:
            raise TooLarge(f"quota: {owner!r} stores {used} bytes of packages; this one ({received.size}) would pass "
                           f"{settings.quota_package_bytes} (TRAINJOBS_QUOTA_PACKAGE_BYTES): delete some "
                           "(trainjobs packages rm)", field="quota")
        final = package_file(settings.resolved_storage_dir, digest)
        if not final.exists():
            os.replace(received.path, final)  # atomic: a worker never reads half a package
        stored.keep(settings, digest, final)  # with a store, where workers fetch it: before the row names it
        package = Package(owner=owner, digest=digest, size=received.size, files=received.files,
                          unpacked_bytes=received.unpacked_bytes)
        db.add(package)
        try:
            db.commit()
        except IntegrityError:
            db.rollback()
            if (winner := find(db, owner=owner, digest=digest)) is None:  # not that race: a bug, as a 500
                raise
            return winner, False
        return package, True
    finally:
        received.path.unlink(missing_ok=True)


def delete(db: Session, *, settings: Settings, owner: str, digest: str) -> None:
    package = get(db, owner=owner, digest=digest)
    db.delete(package)
    db.flush()
    if find(db, owner=None, digest=digest) is None:  # no one else has it: the file goes too
        package_file(settings.resolved_storage_dir, digest).unlink(missing_ok=True)
        stored.forget(settings, digest)
    db.commit()
