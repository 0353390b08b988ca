"""GET /v1/workers: every known worker, what it offers, its state and its current job."""

from fastapi import APIRouter

from service.api.deps import SessionDep, SettingsDep
from service.db import utcnow
from service.workers import service
from service.workers.schemas import WorkerPublic, WorkersPublic

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkersPublic)
def list_workers(db: SessionDep, settings: SettingsDep) -> WorkersPublic:
    """A worker not heard from within the lease (TRAINJOBS_LEASE_S) shows as lost."""
    now = utcnow()
    return WorkersPublic(items=[WorkerPublic.of(w, now=now, lost_after_s=settings.lease_s)
                                for w in service.list_workers(db)])
