"""A job's output files (the final model, what an entrypoint script wrote): list and download."""

from datetime import datetime
from email.utils import formatdate

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel

from service.artifacts import service as storage
from service.artifacts import stored
from service.auth.deps import JobIdDep
from service.deps import SettingsDep
from service.errors import responses
from service.lists import Listing
from service.storage import Store, open_store
from service.storage.store import disposition

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


class ArtifactPublic(BaseModel):
    name: str
    size: int
    modified: datetime  # UTC, ISO 8601, as every time the API returns


class ArtifactsPublic(Listing):
    items: list[ArtifactPublic]
    count: int


def object_store(request: Request, settings: SettingsDep) -> Store | None:
    """The store the API checked at its start (service/api/app.py), or None: the storage dir serves."""
    if not hasattr(request.app.state, "store"):  # an app made without its lifespan (a test's)
        request.app.state.store = open_store(settings)
    return request.app.state.store


@router.get("/{job_id}/artifacts", responses=responses(404))
def list_artifacts(job_id: JobIdDep, request: Request, settings: SettingsDep) -> ArtifactsPublic:
    store = object_store(request, settings)
    files = stored.list_artifacts(store, job_id) if store else storage.list_artifacts(settings, job_id)
    return ArtifactsPublic(items=[ArtifactPublic(**f) for f in files], count=len(files))


@router.get("/{job_id}/artifacts/{name:path}", response_class=StreamingResponse, responses={
    **responses(404, 416), 206: {"description": "the bytes a Range asked for"},
    307: {"description": "a presigned URL of the store (TRAINJOBS_STORE_PRESIGNED_URLS)"}})
def download_artifact(job_id: JobIdDep, name: str, request: Request, settings: SettingsDep) -> Response:
    filename = name.rsplit("/", 1)[-1]
    headers = {"Content-Disposition": disposition(filename)}
    status = 200
    if (store := object_store(request, settings)) is not None:
        key, obj = stored.find_artifact(store, job_id, name)
        if settings.store_presigned_urls and (url := store.presign(key, ttl_s=settings.store_presign_ttl_s,
                                                                   filename=filename)):
            return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})
        span = stored.byte_range(request.headers.get("range"), obj.size)
        chunks, size, modified = stored.read_artifact(store, key, obj, span), obj.size, obj.modified.timestamp()
        headers["Accept-Ranges"] = "bytes"
        if span is not None:
            status, headers["Content-Range"] = 206, f"bytes {span[0]}-{span[1]}/{obj.size}"
            size = span[1] - span[0] + 1
    else:
        # Streamed from the file that was opened and checked (service.py's NOTE), so no Range requests.
        file, info = storage.open_artifact(settings, job_id, name)
        chunks, size, modified = storage.read_chunks(file, info.st_size), info.st_size, info.st_mtime
    headers |= {"Content-Length": str(size), "Last-Modified": formatdate(modified, usegmt=True)}
    return StreamingResponse(chunks, status_code=status, media_type="application/octet-stream", headers=headers)
