"""/v1/tokens (admins make tokens; anyone lists and revokes their own) and /v1/me."""

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from sqlalchemy import select

from service.auth import tokens
from service.auth.deps import AdminDep, PrincipalDep
from service.auth.models import User
from service.db import utcnow
from service.deps import SessionDep
from service.errors import responses
from service.lists import Listing

router = APIRouter(prefix="/v1", tags=["auth"])
UserName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: UserName = Field(description="the token's name; also its user when `user` is not given")
    user: UserName | None = Field(None, description="the owner of the jobs made with it; default: the name")
    role: tokens.Role = "user"
    expires_in_s: Annotated[int | None, Field(gt=0, le=10 * 365 * 86400)] = None
    can_run_entrypoints: StrictBool | None = Field(
        None, description="grant (true) or withdraw (false) the user's right to run their own code; unset: unchanged")
    team: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="put the user in this team (the fair pool shares between teams first)")
    multinode: StrictBool | None = Field(
        None, description="grant (true) or withdraw (false) the user's right to run multi-node gangs; unset: unchanged")


class TokenPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    user: str
    role: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenPublic):
    token: str = Field(description="the secret: shown this once, stored only as a hash")


class TokensPublic(Listing):
    items: list[TokenPublic]
    count: int


class Me(BaseModel):
    user: str
    role: str
    token_id: str | None
    can_run_entrypoints: bool
    multinode: bool = Field(description="may run a multi-node gang (an admin, a user granted it, or every user where "
                            "the operator said so)")


@router.post("/tokens", status_code=201, response_model=TokenCreated, responses=responses(400, 403, 413))
def create_token(body: TokenCreate, request: Request, db: SessionDep, _admin: AdminDep) -> TokenCreated:
    expires_at = utcnow() + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    row, secret = tokens.create(db, name=body.name, user=body.user or body.name, role=body.role,
                                expires_at=expires_at, can_run_entrypoints=body.can_run_entrypoints, team=body.team,
                                multinode=body.multinode)
    if body.can_run_entrypoints is not None:  # the user's other tokens' cached principals carry the old right
        request.app.state.principals.revoke_everywhere()
    return TokenCreated(**TokenPublic.model_validate(row).model_dump(), token=secret)


@router.get("/tokens", response_model=TokensPublic)
def list_tokens(db: SessionDep, principal: PrincipalDep) -> TokensPublic:
    rows = tokens.visible(db, principal)
    return TokensPublic(items=[TokenPublic.model_validate(r) for r in rows], count=len(rows))


@router.delete("/tokens/{token_id}", response_model=TokenPublic, responses=responses(404))
def revoke_token(token_id: Annotated[str, Path(max_length=32)], request: Request, db: SessionDep,
                 principal: PrincipalDep):
    row = tokens.revoke(db, token_id=token_id, principal=principal)  # committed: a process that reads again sees it
    request.app.state.principals.revoke_everywhere()
    return TokenPublic.model_validate(row)


@router.get("/me", response_model=Me)
def whoami(request: Request, db: SessionDep, principal: PrincipalDep) -> Me:
    multinode = (principal.is_admin or request.app.state.settings.multinode_for_all
                 or bool(db.scalar(select(User.multinode).where(User.name == principal.user))))
    return Me(user=principal.user, role=principal.role, token_id=principal.token_id,
              can_run_entrypoints=principal.can_run_entrypoints, multinode=multinode)
