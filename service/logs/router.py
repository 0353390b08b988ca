from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from service.auth.deps import PrincipalDep, visible_job
from service.deps import INT32_MAX, SessionDep
from service.errors import responses
from service.logs import service
from trainjobs.states import TERMINAL

router = APIRouter(prefix="/v1/jobs", tags=["logs"])


@router.get("/{job_id}/logs", response_class=Response, responses=responses(404))
def read_logs(job_id: str, db: SessionDep, principal: PrincipalDep,
              offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
              node_rank: Annotated[int, Query(ge=0, le=1023)] = 0,
              rank: Annotated[int | None, Query(ge=0, le=INT32_MAX)] = None) -> Response:
    """The combined torchrun output (of one node of a gang: node_rank) from a byte offset; X-Next-Offset says
    where to resume. With `rank` (a global rank on that node): that rank's lines without their `[rank<R>]: `
    prefix, and the lines no rank marked (torchrun's own, C-level output); while the job runs, whole lines only."""
    with db:  # the owner check (with the status) and the read in one session, closed in this thread
        job = visible_job(db, job_id=job_id, principal=principal)
        data, next_offset = service.read(db, job_id=job_id, offset=offset, node_rank=node_rank, rank=rank,
                                         final=job.status in TERMINAL)
    headers = {"X-Next-Offset": str(next_offset), "X-Job-Status": job.status}
    return Response(content=data, media_type="text/plain; charset=utf-8", headers=headers)
