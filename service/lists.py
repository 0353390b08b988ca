"""The one envelope of the API's lists: `items` (and what else a list says: `count`, `next_cursor`), and the one way
a list pages (keyset, newest first).

Jobs, sweeps and workers always answered `items`; eight other lists answered `data`. They now answer `items`
too, and keep `data` (the same list) for one release, marked deprecated in the OpenAPI schema and in
CHANGELOG.md.

A page is keyset-paged on an id that sorts by creation (`trainjobs.paths.new_job_id` for jobs and sweeps, the
row's integer for a webhook's deliveries): the next page is the rows below the last id of this one, an index
range however deep the page, and a row added meanwhile never shifts one in or out twice as an OFFSET would.
The cursor on the wire is that last id, as it always was. A list whose rows have no id that sorts by creation
(the workers, named by their hosts) pages the same way in its key's order (`in_order`). A bottom module: it
imports no domain, so every domain's service and schemas may import it.
"""

from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Query
from pydantic import BaseModel, computed_field
from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute

from service.errors import InvalidRequest
from trainjobs.paths import is_job_id

R = TypeVar("R")
CursorQuery = Annotated[str | None, Query(pattern=r"^[0-9a-f]{20}$", description="the last page's next_cursor")]


class Listing(BaseModel):
    """Mix into a list's response model that declares `items`: adds the deprecated `data` alias."""

    items: list[Any]

    # NOTE: marked deprecated in the schema only: pydantic's deprecated= would warn at every response it writes.
    @computed_field(description="the same list as `items`, under its old name (deprecated: it goes in a later "
                    "release, CHANGELOG.md)", json_schema_extra={"deprecated": True})
    @property
    def data(self) -> list[Any]:
        return self.items


def newest_first(query: Select, key: InstrumentedAttribute, *, cursor: str | int | None, limit: int) -> Select:
    """`query`'s page after `cursor`, newest first by `key`, with one row past `limit`: `page_of` cuts it off and
    learns from it whether another page follows."""
    if isinstance(cursor, str) and not is_job_id(cursor):
        raise InvalidRequest("cursor is not a value this API returned", field="cursor")
    query = query.order_by(key.desc()).limit(limit + 1)
    return query.where(key < cursor) if cursor is not None else query


def in_order(query: Select, key: InstrumentedAttribute, *, cursor: str | None, limit: int) -> Select:
    """`query`'s page after `cursor` in `key`'s order (ascending), with one row past `limit`, as `newest_first`."""
    query = query.order_by(key).limit(limit + 1)
    return query.where(key > cursor) if cursor is not None else query


def page_of(rows: Sequence[R], *, limit: int, key: str = "id") -> tuple[list[R], Any]:
    """The page (at most `limit` of `rows`, read by `newest_first`) and the next page's cursor (None: the last)."""
    return list(rows[:limit]), getattr(rows[limit - 1], key) if len(rows) > limit else None
