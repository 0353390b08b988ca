"""The answer to a request body the API cannot take: 400 for one that is not JSON at all, 422 naming each field
at fault otherwise, with "did you mean" for a field that does not exist but is close to one that does.

FastAPI's own answer is a 422 for both, and pydantic's "Extra inputs are not permitted" leaves a user with a typo
(`nproc_per_nod`) to find the field's right name in the docs.
"""

import difflib
import types
import typing

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from trainjobs.spec import JobSpec


def answer(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = jsonable_encoder(exc.errors())
    if bad := next((e for e in errors if e.get("type") == "json_invalid"), None):
        why = (bad.get("ctx") or {}).get("error") or bad.get("msg")
        where = bad["loc"][-1] if isinstance(bad.get("loc", [None])[-1], int) else None
        at = f" at character {where}" if where is not None else ""
        return JSONResponse(status_code=400, content={"detail": f"the body is not valid JSON{at}: {why}",
                                                      "field": "body"})
    for error in errors:
        if error.get("type") == "extra_forbidden" and (close := did_you_mean(error.get("loc") or [])):
            error["msg"] = f"{error['msg']}: did you mean {close!r}?"
            error["did_you_mean"] = close
    return JSONResponse(status_code=422, content={"detail": errors})


def did_you_mean(loc: list) -> str | None:
    """The field closest to an unknown one, among those of the job spec's model at that place (a sweep's or a
    clone's `spec` included); None without a close one."""
    path = [part for part in loc[1:] if isinstance(part, str)]  # past "body"; list indices say nothing here
    if not path:
        return None
    unknown, parents = path[-1], path[:-1]
    for start in [0] + [i + 1 for i, part in enumerate(parents) if part == "spec"]:
        fields = fields_at(JobSpec, parents[start:])
        if fields:
            match = difflib.get_close_matches(unknown, fields, n=1, cutoff=0.6)
            if match:
                return match[0]
    return None


def fields_at(model: type[BaseModel], path: list[str]) -> list[str] | None:
    for part in path:
        field = model.model_fields.get(part)
        inner = field and model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return list(model.model_fields)


def model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or inside Optional, a union, a list or a dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict, typing.Annotated):
        for arg in typing.get_args(annotation):
            if (found := model_in(arg)) is not None:
                return found
    return None
