"""GET /v1/workers: every known worker, what it offers, its state and its current job."""

from fastapi import APIRouter

from service.auth.deps import PrincipalDep
from service.db import utcnow
from service.deps import SessionDep, SettingsDep
from service.jobs import service as jobs
from service.workers import holds, service
from service.workers.schemas import WorkerPublic, WorkersPublic

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkersPublic)
def list_workers(db: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> WorkersPublic:
    """A worker not heard from within the lease (TRAINJOBS_LEASE_S) shows as lost. A user sees the current job
    only when it is theirs (another owner's job id is a 404 everywhere else: no existence leak); an admin, all."""
    now = utcnow()
    workers = service.list_workers(db)
    held = holds.all_held(db)  # worker -> device -> (job, node)
    running = {w.current_job for w in workers if w.current_job} | {j for h in held.values() for j, _ in h.values()}
    shown = running if principal.is_admin else jobs.owned_by(db, job_ids=running, owner=principal.user)
    shown = set(shown)  # once: not per worker (8,000 running jobs × 1,000 workers, bench/control_plane.py)
    return WorkersPublic(items=[WorkerPublic.of(w, now=now, lost_after_s=settings.lease_s,
                                                show_job=w.current_job in shown, held=held.get(w.id),
                                                shown=shown) for w in workers])
