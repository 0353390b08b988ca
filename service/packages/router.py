"""/v1/packages: upload a working directory once (by its sha256), see and delete one's own."""

from datetime import datetime

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from service.auth.deps import PrincipalDep
from service.deps import SessionDep, SettingsDep
from service.errors import Forbidden, responses
from service.lists import Listing
from service.packages import service
from service.packages.models import Package

router = APIRouter(prefix="/v1/packages", tags=["packages"])


class PackagePublic(BaseModel):
    digest: str
    owner: str
    size: int
    files: int
    unpacked_bytes: int
    created_at: datetime

    @classmethod
    def of(cls, package: Package) -> "PackagePublic":
        return cls(digest=package.digest, owner=package.owner, size=package.size, files=package.files,
                   unpacked_bytes=package.unpacked_bytes, created_at=package.created_at)


class PackagesPublic(Listing):
    items: list[PackagePublic]
    count: int
    bytes: int


def _owner(principal) -> str | None:
    return None if principal.is_admin else principal.user


@router.get("", response_model=PackagesPublic)
def list_packages(db: SessionDep, principal: PrincipalDep) -> PackagesPublic:
    """The caller's own packages, oldest first."""
    packages = service.listing(db, owner=principal.user)
    return PackagesPublic(items=[PackagePublic.of(p) for p in packages], count=len(packages),
                          bytes=sum(p.size for p in packages))


@router.get("/{digest}", response_model=PackagePublic, responses=responses(404))
def get_package(digest: str, db: SessionDep, principal: PrincipalDep) -> PackagePublic:
    """A package the caller has (an admin: anyone's); else 404, as for jobs."""
    return PackagePublic.of(service.get(db, owner=_owner(principal), digest=digest))


@router.head("/{digest}", responses=responses(404))
def has_package(digest: str, db: SessionDep, principal: PrincipalDep) -> Response:
    service.get(db, owner=principal.user, digest=digest)  # one's own: what an upload would skip
    return Response(status_code=200)


BODY = {"requestBody": {"required": True, "description": "the package: a gzipped tar of the folder",
                       "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.put("/{digest}", status_code=201, response_model=PackagePublic, openapi_extra=BODY,
            responses={200: {"model": PackagePublic, "description": "the caller has it already"}}
            | responses(403, 413))
async def put_package(digest: str, request: Request, response: Response, principal: PrincipalDep,
                      settings: SettingsDep) -> PackagePublic:
    """The body is the package's .tar.gz, streamed (never held in memory), checked (its sha256 against the name,
    every member against the folder and the limits) and kept: 201 new, 200 the caller has it already."""
    if not principal.can_run_entrypoints:
        raise Forbidden(f"user {principal.user!r} may not run their own code (can_run_entrypoints is off)",
                        field="entrypoint")
    service.check_digest(digest)
    sessions = request.app.state.sessionmaker

    def already() -> Package | None:
        with sessions() as db:
            return service.find(db, owner=principal.user, digest=digest)

    if (package := await run_in_threadpool(already)) is not None:
        response.status_code = 200
        return PackagePublic.of(package)
    length = request.headers.get("content-length")
    received = await service.receive(request.stream(), settings=settings, digest=digest,
                                     declared=int(length) if length and length.isdigit() else None)

    def keep() -> tuple[Package, bool]:
        with sessions() as db:
            return service.store(db, settings=settings, owner=principal.user, digest=digest, received=received)

    package, new = await run_in_threadpool(keep)
    response.status_code = 201 if new else 200
    return PackagePublic.of(package)


@router.delete("/{digest}", status_code=204, responses=responses(404))
def delete_package(digest: str, db: SessionDep, principal: PrincipalDep, settings: SettingsDep) -> Response:
    """Delete one's own package (jobs that already started keep their copy)."""
    service.delete(db, settings=settings, owner=principal.user, digest=digest)
    return Response(status_code=204)
