"""ETags on JSON reads, so a polling client (the dashboard, `watch curl`) gets a 304 when nothing changed.

A job's ETag is its row version (bumped by the database on every write to the job), known before any body
is built: a 304 costs one indexed read of two columns. A list's is the hash of the bytes it carries.
"""

import hashlib
import json

from fastapi import Request, Response
from pydantic import BaseModel

from service.jobs.schemas import JobPublic

# NOTE: the bytes of a job's read follow from its row and from this code; the shape of JobPublic is in the
# tag, so a release that changes the body changes every ETag. A change in how JobPublic.of renders the same
# row (not its schema) must bump RENDERING by hand.
RENDERING = 1
SHAPE = hashlib.sha256(json.dumps([RENDERING, JobPublic.model_json_schema()], sort_keys=True).encode()).hexdigest()[:8]


def etag_of(body: bytes) -> str:
    """A strong validator: the hash of the exact bytes the response carries."""
    return f'"{hashlib.sha256(body).hexdigest()[:32]}"'


def job_etag(version: int) -> str:
    """A strong validator of a job's read: the row's version (the same version renders the same bytes)."""
    return f'"v{version}.{SHAPE}"'


def matches(if_none_match: str | None, etag: str) -> bool:
    """If-None-Match uses the weak comparison (RFC 9110 13.1.2): a W/ prefix does not matter, * matches all."""
    if not if_none_match:
        return False
    candidates = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in candidates or etag in candidates


def not_modified(request: Request, etag: str) -> Response | None:
    """A bodiless 304 when the client's If-None-Match names etag, else None."""
    if matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
    return None


def bytes_with_etag(request: Request, body: bytes, etag: str | None = None) -> Response:
    """A JSON body with its ETag (etag, or the hash of the body), or a 304 when the client holds it."""
    etag = etag or etag_of(body)
    return not_modified(request, etag) or Response(content=body, media_type="application/json",
                                                   headers={"ETag": etag, "Cache-Control": "no-cache"})


def json_with_etag(request: Request, model: BaseModel, etag: str | None = None) -> Response:
    """The model as JSON with its ETag (etag, or the hash of the body), or a 304 when the client holds it."""
    return bytes_with_etag(request, model.model_dump_json().encode(), etag)
