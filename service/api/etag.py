"""Strong ETags on JSON reads, so a polling client (the dashboard, `watch curl`) gets a 304 when nothing changed."""

import hashlib

from fastapi import Request, Response
from pydantic import BaseModel


def etag_of(body: bytes) -> str:
    """A strong validator: the hash of the exact bytes the response carries."""
    return f'"{hashlib.sha256(body).hexdigest()[:32]}"'


def matches(if_none_match: str | None, etag: str) -> bool:
    """If-None-Match uses the weak comparison (RFC 9110 13.1.2): a W/ prefix does not matter, * matches all."""
    if not if_none_match:
        return False
    candidates = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in candidates or etag in candidates


def json_with_etag(request: Request, model: BaseModel) -> Response:
    """The model as JSON with its ETag, or a bodiless 304 when the client already holds this version."""
    body = model.model_dump_json().encode()
    headers = {"ETag": etag_of(body), "Cache-Control": "no-cache"}
    if matches(request.headers.get("if-none-match"), headers["ETag"]):
        return Response(status_code=304, headers=headers)
    return Response(content=body, media_type="application/json", headers=headers)
