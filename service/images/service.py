"""Registry logins: set, list, delete (a user's own, or an admin's for a team), and the one a job's pull uses.

A login belongs to a user or to a team. A job's image is pulled with its owner's own login for that registry,
else with the owner's team's: a user's login is never lent to another user's job. Teams have no admins of their
own yet, so only an admin sets or deletes a team's login; every member sees that it exists (never the password).
"""

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service.auth.models import User
from service.auth.tokens import Principal
from service.db import utcnow
from service.errors import Forbidden, InvalidRequest, NotFound
from service.images import seal
from service.images.models import RegistryCredential
from service.jobs.models import Job, JobEvent
from service.jobs.service import record_event
from service.scheduling.models import Team
from service.settings import Settings

USER, TEAM = "user", "team"
IMAGE_EVENT = "image"  # a job event: the digest one node of one attempt ran its image at
PULLED = re.compile(r"^image (?P<digest>sha256:[0-9a-f]{64}) resolved from \S+ \(attempt (?P<attempt>[0-9]+), "
                    r"node (?P<node_rank>[0-9]+), (?:pulled in (?P<pulled_s>[0-9.]+)s|from the worker's cache)\)$")
# host[:port]: a DNS name, an IPv4 address or a bracketed IPv6 one, as the first part of an image reference
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
REGISTRY = re.compile(rf"^(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?$")
DOCKER_HUB = "docker.io"
DOCKER_HUB_ALIASES = ("index.docker.io", "registry-1.docker.io", "registry.hub.docker.com")


def registry_of(reference: str) -> str:
    """The registry host[:port] of an image reference, as Docker reads it (the first part, when it looks like a
    host; else Docker Hub)."""
    first, sep, _ = reference.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return normal_registry(first)
    return DOCKER_HUB


def normal_registry(name: str) -> str:
    """One spelling per registry: host names are case-blind, and Docker Hub has several."""
    name = name.lower()
    return DOCKER_HUB if name in DOCKER_HUB_ALIASES else name


def check_registry(name: str) -> str:
    if len(name) > 255 or not REGISTRY.match(name):
        raise InvalidRequest(f"registry {name[:100]!r} is not a registry host[:port] (registry.example.com, "
                             "127.0.0.1:5000, docker.io)", field="registry")
    return normal_registry(name)


@dataclass(frozen=True)
class Login:
    """What a pull needs: the username and password, and whose login it is (for the job's messages)."""

    registry: str
    username: str
    password: str
    whose: str  # "user alice" | "team ml"


def _bound_to(scope: str, owner: str, registry: str, username: str) -> str:
    return f"{scope}:{owner}:{registry}:{username}"


def team_of(db: Session, user: str) -> str | None:
    return db.scalar(select(User.team).where(User.name == user))


def _scope_for(db: Session, principal: Principal, team: str | None) -> tuple[str, str]:
    """(scope, owner) the caller acts on: themselves, or a team (admins only)."""
    if team is None:
        return USER, principal.user
    if not principal.is_admin:
        raise Forbidden(f"only an admin sets or deletes team {team!r}'s registry logins (teams have no admins of "
                        "their own yet); set one for yourself without `team`", field="team")
    known = db.get(Team, team) is not None or db.scalar(select(User.name).where(User.team == team).limit(1))
    if not known:
        raise InvalidRequest(f"team {team!r} has no members and no settings: put a user in it first "
                             "(trainjobs token create --team, or PUT /v1/teams)", field="team")
    return TEAM, team


def put(db: Session, settings: Settings, *, principal: Principal, registry: str, username: str, password: str,
        team: str | None = None) -> RegistryCredential:
    """Set (or replace) a login; committed. Its password sealed, bound to this row."""
    registry = check_registry(registry)
    scope, owner = _scope_for(db, principal, team)
    sealed = seal.seal(settings, password, bound_to=_bound_to(scope, owner, registry, username))
    row = db.get(RegistryCredential, (scope, owner, registry))
    now = utcnow()
    if row is None:
        row = RegistryCredential(scope=scope, owner=owner, host=registry, created_at=now)
        db.add(row)
    row.username, row.sealed, row.set_by, row.updated_at = username, sealed, principal.user, now
    db.commit()
    return row


def visible(db: Session, *, principal: Principal) -> list[RegistryCredential]:
    """An admin's: every login. A user's: their own and their team's."""
    query = select(RegistryCredential).order_by(RegistryCredential.scope.desc(), RegistryCredential.owner,
                                                RegistryCredential.host)
    if not principal.is_admin:
        mine = (RegistryCredential.scope == USER) & (RegistryCredential.owner == principal.user)
        team = team_of(db, principal.user)
        if team is not None:
            mine = or_(mine, (RegistryCredential.scope == TEAM) & (RegistryCredential.owner == team))
        query = query.where(mine)
    return list(db.scalars(query))


def remove(db: Session, *, principal: Principal, registry: str, team: str | None = None,
           user: str | None = None) -> RegistryCredential:
    """Delete the caller's login (a team's, or another user's: admins only); committed. 404 when there is none."""
    registry = check_registry(registry)
    if user is not None and user != principal.user:
        if not principal.is_admin:
            raise Forbidden("only an admin deletes another user's registry login", field="user")
        scope, owner = USER, user
    else:
        scope, owner = (USER, principal.user) if team is None else (TEAM, team)
        if team is not None and not principal.is_admin:
            raise Forbidden(f"only an admin deletes team {team!r}'s registry logins", field="team")
    row = db.get(RegistryCredential, (scope, owner, registry))
    if row is None:
        raise NotFound(f"no registry login for {registry} is stored for {scope} {owner}", field="registry")
    db.delete(row)
    db.commit()
    return row


def login_for(db: Session, settings: Settings, *, owner: str, registry: str) -> Login | None:
    """The login a job of `owner` pulls from `registry` with: the owner's own, else the owner's team's."""
    registry = normal_registry(registry)
    rows = {row.scope: row for row in db.scalars(select(RegistryCredential).where(
        RegistryCredential.host == registry,
        or_((RegistryCredential.scope == USER) & (RegistryCredential.owner == owner),
            (RegistryCredential.scope == TEAM) & (RegistryCredential.owner == team_of(db, owner)))))}
    row = rows.get(USER) or rows.get(TEAM)
    if row is None:
        return None
    password = seal.unseal(settings, row.sealed, bound_to=_bound_to(row.scope, row.owner, row.host, row.username))
    return Login(registry, row.username, password, f"{row.scope} {row.owner}")


@dataclass(frozen=True)
class Pulled:
    """The digest one node of one attempt ran the job's image at."""

    attempt: int
    node_rank: int
    digest: str
    pulled_s: float | None  # None: found in the worker's cache
    time: datetime


def record_pulled(db: Session, *, job_id: str, attempt: int, node_rank: int, image: str, digest: str,
                  pulled_s: float | None) -> None:
    """The job event "image sha256:… resolved from X (attempt N, node R, pulled in S s)", once per node of an
    attempt (a replay adds none); not committed."""
    said = f"image {digest} resolved from {image} (attempt {attempt}, node {node_rank}, "
    how = f"pulled in {pulled_s:.1f}s" if pulled_s is not None else "from the worker's cache"
    if db.scalar(select(JobEvent.id).where(JobEvent.job_id == job_id, JobEvent.kind == IMAGE_EVENT,
                                           JobEvent.detail.startswith(said, autoescape=True)).limit(1)) is None:
        record_event(db, job_id=job_id, kind=IMAGE_EVENT, detail=f"{said}{how})")


def pulls_of(db: Session, *, job_id: str) -> list[Pulled]:
    """Every digest the job's attempts ran its image at, oldest first (read back from its image events)."""
    found = []
    for when, detail in db.execute(select(JobEvent.time, JobEvent.detail).where(
            JobEvent.job_id == job_id, JobEvent.kind == IMAGE_EVENT).order_by(JobEvent.id)):
        if (m := PULLED.match(detail or "")) is not None:
            found.append(Pulled(int(m["attempt"]), int(m["node_rank"]), m["digest"],
                                float(m["pulled_s"]) if m["pulled_s"] else None, when))
    return found


def image_of(db: Session, *, job_id: str) -> str | None:
    spec = db.scalar(select(Job.spec).where(Job.id == job_id))
    return spec.image if spec is not None else None
