"""/v1/registry-credentials: a user's (or, for an admin, a team's) logins to container registries, for the images
their jobs name. The password goes in and never comes out: a list shows who, where and as whom, not the secret."""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from service.auth.deps import JobIdDep, PrincipalDep
from service.deps import SessionDep, SettingsDep
from service.errors import responses
from service.images import calls, service  # noqa: F401 (calls: the worker protocol's image calls register)
from service.images.models import RegistryCredential

router = APIRouter(prefix="/v1", tags=["images"])
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")]
RegistryPath = Annotated[str, Path(min_length=1, max_length=255, description="host[:port]: registry.example.com, "
                                   "127.0.0.1:5000, docker.io")]
NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"


class LoginPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    username: str = Field(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f:]+$",
                          description="the registry's user name (no colon: HTTP basic auth splits there)")
    password: str = Field(min_length=1, max_length=8192, pattern=NO_CONTROL,
                          description="the password or access token: stored sealed, never shown again")
    team: Name | None = Field(None, description="admins: set the team's login (its members' jobs use it where "
                              "they have none of their own)")


class LoginPublic(BaseModel):
    registry: str
    scope: str = Field(description="user | team")
    owner: str = Field(description="the user's or the team's name")
    username: str
    set_by: str
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, row: RegistryCredential) -> "LoginPublic":
        return cls(registry=row.host, scope=row.scope, owner=row.owner, username=row.username,
                   set_by=row.set_by, created_at=row.created_at, updated_at=row.updated_at)


class LoginsPublic(BaseModel):
    items: list[LoginPublic]
    count: int


@router.put("/registry-credentials/{registry}", response_model=LoginPublic, responses=responses(403, 422))
def put_login(registry: RegistryPath, body: LoginPut, db: SessionDep, settings: SettingsDep,
              principal: PrincipalDep) -> LoginPublic:
    """Set your login to `registry` (or a team's: admins), replacing the one there was."""
    row = service.put(db, settings, principal=principal, registry=registry, username=body.username,
                      password=body.password, team=body.team)
    return LoginPublic.of(row)


@router.get("/registry-credentials", response_model=LoginsPublic)
def list_logins(db: SessionDep, principal: PrincipalDep) -> LoginsPublic:
    """Your logins and your team's (an admin's: everyone's); never a password."""
    rows = service.visible(db, principal=principal)
    return LoginsPublic(items=[LoginPublic.of(r) for r in rows], count=len(rows))


@router.delete("/registry-credentials/{registry}", response_model=LoginPublic, responses=responses(403, 404, 422))
def delete_login(registry: RegistryPath, db: SessionDep, principal: PrincipalDep,
                 team: Annotated[Name | None, Query(description="admins: the team's login")] = None,
                 user: Annotated[Name | None, Query(description="admins: another user's login")] = None
                 ) -> LoginPublic:
    """Delete your login to `registry` (a team's or another user's: admins)."""
    return LoginPublic.of(service.remove(db, principal=principal, registry=registry, team=team, user=user))


class PulledPublic(BaseModel):
    attempt: int
    node_rank: int
    digest: str = Field(description="the manifest digest the node ran: sha256:<hex>")
    pulled_s: float | None = Field(description="seconds its pull and unpack took; null: the worker had it")
    time: datetime


class JobImagePublic(BaseModel):
    image: str | None = Field(description="the spec's reference (a tag, or pinned)")
    resolved: list[PulledPublic] = Field(description="what each node of each attempt ran it at, oldest first")


@router.get("/jobs/{job_id}/image", response_model=JobImagePublic, responses=responses(404))
def job_image(job_id: JobIdDep, db: SessionDep) -> JobImagePublic:
    """The job's image and the digest each of its attempts' nodes ran (a tag moves; this is what ran)."""
    return JobImagePublic(image=service.image_of(db, job_id=job_id),
                          resolved=[PulledPublic(**vars(p)) for p in service.pulls_of(db, job_id=job_id)])
