"""The answer to a request body the API cannot take: 400 for one that is not JSON at all, 422 naming each field
at fault otherwise, with "did you mean" for a field that does not exist but is close to one that does.

FastAPI's own answer is a 422 for both, and pydantic's "Extra inputs are not permitted" leaves a user with a typo
(`nproc_per_nod`) to find the field's right name in the docs.
"""

import difflib
import types
import typing
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from trainjobs.spec import JobSpec


def answer(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = jsonable_encoder(exc.errors())
    if bad := next((e for e in errors if e.get("type") == "json_invalid"), None):
        why = (bad.get("ctx") or {}).get("error") or bad.get("msg")
        where = bad["loc"][-1] if isinstance(bad.get("loc", [None])[-1], int) else None
        at = f" at character {where}" if where is not None else ""
        return JSONResponse(status_code=400, content={"detail": f"the body is not valid JSON{at}: {why}",
                                                      "field": "body"})
    errors = one_per_field(errors, body_model(request))
    for error in errors:
        if error.get("type") == "extra_forbidden" and (close := did_you_mean(error.get("loc") or [])):
            error["msg"] = f"{error['msg']}: did you mean {close!r}?"
            error["did_you_mean"] = close
    return JSONResponse(status_code=422, content={"detail": errors})


def body_model(request: Request) -> Any:
    """The annotation of the route's body (JobSpec, a sweep, ...); None where the route has none."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    return getattr(getattr(field, "field_info", None), "annotation", None)


def one_per_field(errors: list[dict], body: Any) -> list[dict]:
    """The errors with the union branches pydantic names in `loc` taken out (`data.synthetic_regression.
    batch_size.constrained-int` is the field `data.batch_size`), and the errors each branch of a union gave at one
    field joined into one sentence: "Input should be greater than or equal to 1, or 'auto'".

    NOTE: pydantic tries every branch of a union and reports each one's error under the branch's label, so a
    negative batch size (an int >= 1 or "auto") read as two errors about two fields that do not exist.
    """
    joined: dict[tuple, dict] = {}
    out: list[dict] = []
    for error in errors:
        loc = list(error.get("loc") or [])
        # The strict-JSON check's errors name the body's own keys (service/api/strict_json.py): no branch in them.
        raw = error.get("type") == "finite_number"
        plain = [loc[0], *without_branches(loc[1:], body)] if loc[:1] == ["body"] and body is not None and not raw \
            else loc
        if plain == loc:
            out.append(error)
            continue
        if (first := joined.get(tuple(plain))) is None:
            joined[tuple(plain)] = first = {**error, "loc": plain}
            out.append(first)
        else:
            first["msg"] = join_messages(first["msg"], error.get("msg", ""))
    return out


def join_messages(first: str, other: str) -> str:
    prefix = "Input should be "
    if first.startswith(prefix) and other.startswith(prefix):
        return f"{first}, or {other.removeprefix(prefix)}"
    return f"{first}; or {other[:1].lower()}{other[1:]}"


def without_branches(path: list, annotation: Any) -> list:
    """`path` (a body's loc past "body") without the union branch labels in it, walking the body's models."""
    out: list = []
    for part in path:
        annotation = unwrapped(annotation)
        if annotation is None:  # past what the models say (a dict's keys, a scalar): kept as it is
            out.append(part)
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):  # `part` names a branch
            annotation = branch(annotation, part)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append(part)
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            annotation = field.annotation if field is not None else None
        elif typing.get_origin(annotation) in (list, tuple, set, frozenset) and isinstance(part, int):
            out.append(part)
            annotation = next(iter(typing.get_args(annotation)), None)
        elif typing.get_origin(annotation) is dict:
            out.append(part)
            annotation = typing.get_args(annotation)[1] if typing.get_args(annotation) else None
        else:
            out.append(part)
            annotation = None
    return out


def unwrapped(annotation: Any) -> Any:
    """Annotated[X, ...] is X; X | None is X (pydantic names no branch for None)."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in (
                args := typing.get_args(annotation)):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1:
                return typing.Union[tuple(rest)]  # noqa: UP007 - built from a tuple of members
            annotation = rest[0]
        else:
            return annotation


def branch(union: Any, label: Any) -> Any:
    """The member of `union` that pydantic's `label` names: a model by its class name or its tag (a Literal field,
    as a discriminated union names it); None for a scalar's label (`constrained-int`, `literal['auto']`)."""
    for member in typing.get_args(union):
        member = unwrapped(member)
        if not (isinstance(member, type) and issubclass(member, BaseModel)):
            continue
        if label == member.__name__ or any(
                typing.get_origin(unwrapped(f.annotation)) is typing.Literal and label in typing.get_args(
                    unwrapped(f.annotation)) for f in member.model_fields.values()):
            return member
    return None


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
