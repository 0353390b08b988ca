"""The API speaks strict JSON: NaN, Infinity and -Infinity (and numbers too large for a float) are refused.

Python's json (which Starlette parses bodies with) reads those tokens as floats, and a non-finite float breaks
whatever meets it next: a pydantic bound, a JSON column, the 422 that would echo it. So every /v1 route checks
its body once, as a 422 naming each field at fault, before the body's own validation sees it.
"""

import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError

MAX_ERRORS = 20  # a body of a million NaNs gets a short answer
BODY_METHODS = {"POST", "PUT", "PATCH"}
MESSAGE = "Input should be a finite number (the API speaks strict JSON: no NaN, Infinity or -Infinity)"


def non_finite_paths(value: Any, limit: int = MAX_ERRORS) -> list[tuple[tuple[str | int, ...], float]]:
    """Where a parsed JSON value holds a non-finite float, in document order (a loop: deep JSON needs no stack)."""
    found: list[tuple[tuple[str | int, ...], float]] = []
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack and len(found) < limit:
        path, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            found.append((path, node))
        elif isinstance(node, dict):
            stack.extend(reversed([((*path, key), item) for key, item in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([((*path, i), item) for i, item in enumerate(node)]))
    return found


def as_token(number: float) -> str:
    """The token the client sent, as the 422 shows it (a JSON string: the answer stays strict JSON)."""
    return "NaN" if math.isnan(number) else ("Infinity" if number > 0 else "-Infinity")


async def refuse_non_finite(request: Request) -> None:
    """A route dependency: a body holding a non-finite number is a 422 naming every such field."""
    if request.method not in BODY_METHODS:
        return
    try:
        body = await request.json()  # parsed once: FastAPI has read and cached it already
    except ValueError:  # not JSON at all: the body's own validation answers that
        return
    errors = [{"type": "finite_number", "loc": ("body", *path), "msg": MESSAGE, "input": as_token(number)}
              for path, number in non_finite_paths(body)]
    if errors:
        raise RequestValidationError(errors)
