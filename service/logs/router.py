from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from service.api.deps import INT32_MAX, SessionDep
from service.auth.deps import JobIdDep
from service.errors import responses
from service.jobs import service as jobs
from service.logs import service

router = APIRouter(prefix="/v1/jobs", tags=["logs"])


@router.get("/{job_id}/logs", response_class=Response, responses=responses(404))
def read_logs(job_id: JobIdDep, db: SessionDep, offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0,
              node_rank: Annotated[int, Query(ge=0, le=1023)] = 0) -> Response:
    """The combined torchrun output (of one node of a gang: node_rank) from a byte offset; X-Next-Offset says
    where to resume."""
    job = jobs.get(db, job_id=job_id)
    data, next_offset = service.read(db, job_id=job_id, offset=offset, node_rank=node_rank)
    headers = {"X-Next-Offset": str(next_offset), "X-Job-Status": job.status}
    return Response(content=data, media_type="text/plain; charset=utf-8", headers=headers)
