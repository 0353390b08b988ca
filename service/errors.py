"""One error hierarchy (rooted in trainjobs/errors.py); service/api/app.py maps it to HTTP in one place."""

from typing import Any

from pydantic import BaseModel, Field

from trainjobs.errors import InvalidRequest, NotFound, TrainjobsError

__all__ = ["ArtifactNotFound", "ErrorPublic", "Forbidden", "GatewayTimeout", "IdempotencyConflict", "InvalidRequest",
           "InvalidTransition", "JobNotFound", "NotFound", "TrainjobsError", "responses"]


class JobNotFound(NotFound):
    def __init__(self, job_id: str):
        super().__init__(f"job {job_id!r} not found", field="job_id")


class ArtifactNotFound(NotFound):
    pass


class InvalidTransition(TrainjobsError):
    status_code = 409


class IdempotencyConflict(TrainjobsError):
    """An Idempotency-Key reused with another spec: the client's retry is not the request it first made."""

    status_code = 409

    def __init__(self, job_id: str):
        super().__init__(f"this Idempotency-Key already made job {job_id} from another spec; use a new key",
                         field="Idempotency-Key")


class Forbidden(TrainjobsError):
    """The caller is known but lacks the right (never used to hide another owner's job: that is a 404)."""

    status_code = 403


class GatewayTimeout(TrainjobsError):
    """A worker did not answer in time (the request stays on record; its answer may come later)."""

    status_code = 504


class ErrorPublic(BaseModel):
    """Every error this API raises on purpose: what went wrong, and the field (or header) at fault."""

    detail: str | list[dict[str, Any]] = Field(description="a message; a list of field errors for a 422 "
                                                            "from request validation")
    field: str | None = None


DESCRIPTIONS = {
    400: "the body could not be read as JSON",
    401: "no token, or an invalid, revoked or expired one (WWW-Authenticate: Bearer)",
    403: "the token lacks the right",
    404: "not found, or not yours",
    409: "conflicts with the current state",
    413: "request body too large",
    416: "the Range asks for no byte of the file (Content-Range gives its size)",
    422: "invalid input; `field` or the detail's `loc` names it",
    429: "too many submissions or the owner's quota is full (Retry-After)",
    504: "a worker did not answer in time",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, so the schema tells no lies."""
    return {code: {"model": ErrorPublic, "description": DESCRIPTIONS[code]} for code in codes}
