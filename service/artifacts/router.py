"""A job's output files (the final model, what an entrypoint script wrote): list and download."""

from fastapi import APIRouter
from fastapi.responses import FileResponse
from pydantic import BaseModel

from service.api.deps import SettingsDep
from service.artifacts import service as storage
from service.auth.deps import JobIdDep
from service.errors import ArtifactNotFound, responses

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


class ArtifactPublic(BaseModel):
    name: str
    size: int
    modified: float


class ArtifactsPublic(BaseModel):
    data: list[ArtifactPublic]
    count: int


@router.get("/{job_id}/artifacts", responses=responses(404))
def list_artifacts(job_id: JobIdDep, settings: SettingsDep) -> ArtifactsPublic:
    files = storage.list_artifacts(settings, job_id)
    return ArtifactsPublic(data=[ArtifactPublic(**f) for f in files], count=len(files))


@router.get("/{job_id}/artifacts/{name:path}", response_class=FileResponse, responses=responses(404))
def download_artifact(job_id: JobIdDep, name: str, settings: SettingsDep) -> FileResponse:
    path = storage.artifact_path(settings, job_id, name)
    if not path.is_file():
        raise ArtifactNotFound(f"job {job_id} has no artifact {name!r}", field="name")
    return FileResponse(path, filename=path.name, media_type="application/octet-stream")
