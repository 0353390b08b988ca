"""POST /v1/sweeps and its reads and cancel: owner-isolated as jobs are (another user's sweep is a 404)."""

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.auth.deps import PrincipalDep
from service.auth.limits import check_submission
from service.deps import RedisDep, SessionDep, SettingsDep
from service.errors import InvalidTransition, responses
from service.jobs import lifecycle
from service.lists import CursorQuery
from service.sweeps import controller, service
from service.sweeps.schemas import SweepPublic, SweepsPublic, TrialPublic, TrialsPublic
from trainjobs import sweep as sweeps
from trainjobs.states import SweepStatus

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


def public(db, row) -> SweepPublic:
    config = service.config_of(row)
    return SweepPublic.of(row, service.trials(db, metrics={row.id: config.metric})[row.id])


@router.post("", status_code=201, response_model=SweepPublic, responses=responses(400, 403, 404, 413, 429))
def submit_sweep(body: sweeps.SweepSpec, response: Response, db: SessionDep, redis: RedisDep,
                 settings: SettingsDep, principal: PrincipalDep):
    """Check the whole search before any trial exists (every parameter path and value, every grid combination,
    the metric), store the sweep, and make its first `parallel` trials at once; the sweeper makes the rest."""
    sweeps.check(body)
    check_submission(db, redis, settings, principal, body.spec)  # rights and rate now; quota per trial
    db.rollback()
    row = service.create(db, sweep=body, principal=principal)
    db.commit()
    controller.advance(db, redis, settings, row)
    response.headers["Location"] = f"/v1/sweeps/{row.id}"
    db.refresh(row)
    return public(db, row)


@router.get("", response_model=SweepsPublic)
def list_sweeps(
    db: SessionDep,
    principal: PrincipalDep,
    status: SweepStatus | None = None,
    owner: Annotated[str | None, Query(max_length=64, description="admins only; users see their own")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: CursorQuery = None,
):
    owner = owner if principal.is_admin else principal.user
    rows, next_cursor = service.list_page(db, owner=owner, status=status, limit=limit, cursor=cursor)
    found = service.trials(db, metrics={r.id: service.config_of(r).metric for r in rows})
    return SweepsPublic(items=[SweepPublic.of(r, found[r.id]) for r in rows], next_cursor=next_cursor)


@router.get("/{sweep_id}", response_model=SweepPublic, responses=responses(404))
def read_sweep(sweep_id: str, db: SessionDep, principal: PrincipalDep):
    return public(db, service.visible(db, sweep_id=sweep_id, principal=principal))


@router.get("/{sweep_id}/trials", response_model=TrialsPublic, responses=responses(404))
def list_trials(sweep_id: str, db: SessionDep, principal: PrincipalDep):
    """Every trial made so far, in trial order: its parameters, status (and reason), steps, the metric's last
    and best value."""
    row = service.visible(db, sweep_id=sweep_id, principal=principal)
    rows = service.trials(db, metrics={row.id: service.config_of(row).metric})[row.id]
    return TrialsPublic(items=[TrialPublic.of(t) for t in rows], count=len(rows))


@router.post("/{sweep_id}/cancel", response_model=SweepPublic, responses=responses(404, 409))
def cancel_sweep(sweep_id: str, db: SessionDep, redis: RedisDep, settings: SettingsDep, principal: PrincipalDep):
    """The sweep makes no more trials; its queued trials are cancelled at once, its running ones by the normal
    cancel path (the sweeper finishes the job if this request dies half-way)."""
    row = service.visible(db, sweep_id=sweep_id, principal=principal)
    if not lifecycle.move_sweep(db, sweep_id=row.id, to=SweepStatus.CANCELLED):
        db.refresh(row)
        if row.status != SweepStatus.CANCELLED:
            raise InvalidTransition(f"sweep {sweep_id} already {row.status}; it cannot be cancelled", field="status")
    db.commit()
    controller.cancel_trials(db, redis, settings, sweep_id=row.id)
    db.refresh(row)
    return public(db, row)
