"""/v1/queue (the waiting jobs in the order they would start, and why), /v1/teams and PATCH /v1/users/{name}."""

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from service.auth.deps import AdminDep, PrincipalDep
from service.auth.models import User
from service.deps import RedisDep, SessionDep, SettingsDep
from service.errors import NotFound, responses
from service.jobs.models import Job
from service.lists import Listing
from service.scheduling import queue_view
from service.scheduling import service as scheduling
from service.scheduling.models import Team
from trainjobs.states import JobStatus

router = APIRouter(prefix="/v1", tags=["scheduling"])
Name = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")]
TeamName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
HOUR = 3600.0


class QueuedJob(BaseModel):
    position: int = Field(description="1 = the next to start")
    id: str
    name: str
    owner: str
    priority: str
    reason: str | None = Field(description="why it waits; null: it is starting now")
    estimated_start: datetime | None = Field(description="from running jobs' progress and timeouts (errs late)")
    owner_usage_device_hours: float
    owner_share: float = Field(description="the owner's usage ÷ weight, in device-hours: lower goes first")


class Standing(BaseModel):
    user: str
    team: str | None
    weight: float
    max_slots: int | None
    usage_device_hours: float
    share: float
    team_share: float | None


class Reserved(BaseModel):
    job_id: str | None = Field(description="null when the job is another user's")
    workers: int
    held: int = Field(description="of them, free now (held for the job)")
    fill_by: datetime = Field(description="when the last of them is expected free, by their jobs' timeouts")
    deadline: datetime = Field(description="a job of higher priority takes one of these workers only if it ends "
                                           "before this")
    devices: dict[str, list[int]] = Field(default_factory=dict, description="on each shared worker whose devices "
                                          "are known: the device indices held for the gang, which it gets once "
                                          "they are free (worker -> indices)")


class QueuePublic(BaseModel):
    policy: str
    planned_at: datetime = Field(description="when the plan this answer shows was made")
    planned_by: Literal["pass", "request"] = Field(description="pass: the scheduling pass's plan, the one it "
                                                   "assigns by; request: no fresh pass result, planned for this "
                                                   "request alone")
    waiting: int = Field(description="every queued job (planned: at most the oldest 2,000)")
    jobs: list[QueuedJob] = Field(description="yours (every job, for an admin), in the order they would start")
    others_waiting: int = Field(description="queued jobs of other users, counted only")
    others_ahead: int = Field(description="of those, how many are ahead of your first waiting job")
    you: Standing
    reservations: list[Reserved] = Field(description="gangs that waited reserve_after_s, the oldest first")


def _when(t: float | None) -> datetime | None:
    return datetime.fromtimestamp(t, tz=UTC) if t is not None else None


@router.get("/queue", response_model=QueuePublic)
def read_queue(db: SessionDep, redis: RedisDep, settings: SettingsDep, principal: PrincipalDep) -> QueuePublic:
    """The last scheduling pass's plan (queue_view.py), filtered for the caller; without a fresh one, one plan
    on this request's snapshot."""
    view = queue_view.load(redis, prefix=settings.queue_prefix)
    if view is None:
        view = queue_view.plan_now(db, settings)
    elif (newest := db.scalar(select(func.max(Job.queued_at)).where(Job.status == JobStatus.QUEUED))) is not None:
        view = queue_view.wait_newer(redis, prefix=settings.queue_prefix, view=view, after=newest.timestamp())
    admin = principal.role == "admin"
    jobs, shares, usage = view["jobs"], view["shares"], view["usage"]
    mine = [j for j in jobs if admin or j["owner"] == principal.user]
    names = {r.id: r.name for r in db.execute(select(Job.id, Job.name).where(Job.id.in_([j["id"] for j in mine])))}
    first = next((j["position"] for j in jobs if j["owner"] == principal.user), None)
    others = [j for j in jobs if j["owner"] != principal.user]
    team, weight, max_slots = view["accounts"].get(principal.user) or [None, 1.0, None]
    you = Standing(user=principal.user, team=team, weight=weight, max_slots=max_slots,
                   usage_device_hours=usage.get(principal.user, 0.0) / HOUR,
                   share=shares.get(principal.user, 0.0) / HOUR,
                   team_share=view["team_shares"].get(team, 0.0) / HOUR if team else None)
    reservations = [Reserved(job_id=r["job_id"] if admin or r["owner"] == principal.user else None,
                             workers=r["workers"], held=r["held"], fill_by=_when(r["fill_at"]),
                             deadline=_when(r["deadline"]), devices=r["devices"]) for r in view["reservations"]]
    return QueuePublic(
        policy=view["policy"], planned_at=_when(view["planned_at"]), planned_by=view["planned_by"],
        waiting=len(jobs),
        jobs=[QueuedJob(position=j["position"], id=j["id"], name=names.get(j["id"], ""), owner=j["owner"],
                        priority=j["priority"], reason=j["reason"], estimated_start=_when(j["estimated_start"]),
                        owner_usage_device_hours=usage.get(j["owner"], 0.0) / HOUR,
                        owner_share=shares.get(j["owner"], 0.0) / HOUR) for j in mine],
        others_waiting=len(others), others_ahead=sum(1 for j in others if first is None or j["position"] < first),
        you=you, reservations=reservations)


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `false` is no number of slots

    weight: float = Field(1.0, gt=0, le=1000, description="its share of the pool relative to other teams")
    max_slots: int | None = Field(None, ge=0, le=1_000_000, description="slots its running jobs may hold at once")


class TeamPublic(TeamBody):
    model_config = ConfigDict(from_attributes=True)

    name: str
    members: list[str] = []
    usage_device_hours: float = 0.0


class TeamsPublic(Listing):
    items: list[TeamPublic]
    count: int


@router.put("/teams/{name}", response_model=TeamPublic, responses=responses(400, 403, 413))
def put_team(name: Name, body: TeamBody, db: SessionDep, _admin: AdminDep) -> TeamPublic:
    row = db.get(Team, name)
    if row is None:
        row = Team(name=name)
        db.add(row)
    row.weight, row.max_slots = body.weight, body.max_slots
    db.commit()
    return _team(db, row, {})


@router.get("/teams", response_model=TeamsPublic)
def list_teams(db: SessionDep, settings: SettingsDep, _principal: PrincipalDep) -> TeamsPublic:
    usage = scheduling.usage_now(db, now=datetime.now(UTC), half_life_s=settings.fair_share_half_life_s)
    rows = [_team(db, t, usage) for t in db.scalars(select(Team).order_by(Team.name))]
    return TeamsPublic(items=rows, count=len(rows))


@router.delete("/teams/{name}", response_model=TeamPublic, responses=responses(403, 404))
def delete_team(name: Name, db: SessionDep, _admin: AdminDep) -> TeamPublic:
    """The team's weight and quota go; its members keep the name (a team of weight 1 and no quota)."""
    row = db.get(Team, name)
    if row is None:
        raise NotFound(f"no team {name!r}")
    out = _team(db, row, {})
    db.delete(row)
    db.commit()
    return out


def _team(db, row: Team, usage: dict[str, float]) -> TeamPublic:
    members = list(db.scalars(select(User.name).where(User.team == row.name).order_by(User.name)))
    return TeamPublic(name=row.name, weight=row.weight, max_slots=row.max_slots, members=members,
                      usage_device_hours=sum(usage.get(m, 0.0) for m in members) / HOUR)


class UserPatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `0` is no yes-or-no, `false` no number

    team: TeamName | None = Field(None, description="its team; \"\" or null with `clear_team` to leave one")
    clear_team: bool = False
    weight: float | None = Field(None, gt=0, le=1000, description="its share within its team (default 1)")
    max_slots: int | None = Field(None, ge=0, le=1_000_000, description="slots its running jobs may hold at once")
    clear_max_slots: bool = False
    multinode: bool | None = Field(None, description="grant (true) or withdraw (false) the right to run a multi-node "
                                   "gang, whose ranks share their hosts' network; unset: unchanged")


class UserPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    team: str | None
    weight: float
    max_slots: int | None
    can_run_entrypoints: bool
    multinode: bool


@router.patch("/users/{name}", response_model=UserPublic, responses=responses(400, 403, 404, 413))
def patch_user(name: Name, body: UserPatch, db: SessionDep, _admin: AdminDep) -> UserPublic:
    row = db.get(User, name)
    if row is None:
        raise NotFound(f"no user {name!r}")
    if body.team is not None:
        row.team = body.team
    if body.clear_team:
        row.team = None
    if body.weight is not None:
        row.weight = body.weight
    if body.max_slots is not None:
        row.max_slots = body.max_slots
    if body.clear_max_slots:
        row.max_slots = None
    if body.multinode is not None:  # read at each admission from the row: no cached principal to revoke
        row.multinode = body.multinode
    db.commit()
    return UserPublic.model_validate(row)


@router.get("/users/{name}", response_model=UserPublic, responses=responses(403, 404))
def read_user(name: Name, db: SessionDep, principal: PrincipalDep) -> UserPublic:
    row = db.get(User, name)
    if row is None or (principal.role != "admin" and principal.user != name):
        raise NotFound(f"no user {name!r}")
    return UserPublic.model_validate(row)
