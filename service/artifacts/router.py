"""A job's output files (the final model, what an entrypoint script wrote): list and download."""

from datetime import datetime
from email.utils import formatdate
from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from service.api.deps import SettingsDep
from service.artifacts import service as storage
from service.auth.deps import JobIdDep
from service.errors import responses

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


class ArtifactPublic(BaseModel):
    name: str
    size: int
    modified: datetime  # UTC, ISO 8601, as every time the API returns


class ArtifactsPublic(BaseModel):
    data: list[ArtifactPublic]
    count: int


@router.get("/{job_id}/artifacts", responses=responses(404))
def list_artifacts(job_id: JobIdDep, settings: SettingsDep) -> ArtifactsPublic:
    files = storage.list_artifacts(settings, job_id)
    return ArtifactsPublic(data=[ArtifactPublic(**f) for f in files], count=len(files))


@router.get("/{job_id}/artifacts/{name:path}", response_class=StreamingResponse, responses=responses(404))
def download_artifact(job_id: JobIdDep, name: str, settings: SettingsDep) -> StreamingResponse:
    # Streamed from the file that was opened and checked (service.py's NOTE), so no Range requests.
    file, info = storage.open_artifact(settings, job_id, name)
    filename = name.rsplit("/", 1)[-1]
    disposition = (f'attachment; filename="{filename}"' if quote(filename) == filename
                   else f"attachment; filename*=utf-8''{quote(filename)}")
    headers = {"Content-Length": str(info.st_size), "Last-Modified": formatdate(info.st_mtime, usegmt=True),
               "Content-Disposition": disposition}
    return StreamingResponse(storage.read_chunks(file, info.st_size), media_type="application/octet-stream",
                             headers=headers)
