"""GET /v1/workers: the known workers, a page at a time, what each offers, its state and the jobs it runs."""

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from service.auth.deps import PrincipalDep
from service.db import utcnow
from service.deps import SessionDep, SettingsDep
from service.jobs import service as jobs
from service.jobs.etag import json_with_etag
from service.workers import holds, listing
from service.workers.schemas import WorkerPublic, WorkersPublic

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("", response_model=WorkersPublic)
def list_workers(
    request: Request,
    db: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    state: Annotated[list[listing.WorkerState] | None, Query(description="any of these (repeatable)")] = None,
    label: Annotated[list[str] | None, Query(description="key=value, every one (repeatable)")] = None,
    min_free_devices: Annotated[int | None, Query(ge=1, le=4096, description="workers with at least this many "
                                                  "devices healthy and held by no job")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(min_length=1, max_length=256,
                                        description="the last page's next_cursor")] = None,
) -> Response:
    """By worker id, a page at a time (next_cursor: the next page's cursor, null on the last). A worker not heard
    from within the lease (TRAINJOBS_LEASE_S) shows as lost. A user sees a job id only when the job is theirs
    (another owner's job id is a 404 everywhere else: no existence leak); an admin, all. With an ETag (the
    dashboard's poll of an unchanged page gets a 304)."""
    labels = listing.parse_labels(label or [])
    now = utcnow()
    with db:
        rows, next_cursor = listing.page(db, lost_after_s=settings.lease_s, limit=limit, cursor=cursor, states=state,
                                         labels=labels, min_free_devices=min_free_devices)
        held = holds.held_on(db, worker_ids=[w.id for w in rows])  # worker -> device -> (job, node)
        running = {w.current_job for w in rows if w.current_job} | {j for h in held.values() for j, _ in h.values()}
        shown = running if principal.is_admin else jobs.owned_by(db, job_ids=running, owner=principal.user)
    page = WorkersPublic(items=[WorkerPublic.of(w, now=now, lost_after_s=settings.lease_s,
                                                show_job=w.current_job in shown, held=held.get(w.id),
                                                shown=shown) for w in rows], next_cursor=next_cursor)
    return json_with_etag(request, page)  # the model is the schema: not validated a second time on the way out
