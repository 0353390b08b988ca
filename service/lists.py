"""The one envelope of the API's lists: `items` (and what else a list says: `count`, `next_cursor`).

Jobs, sweeps and workers always answered `items`; eight other lists answered `data`. They now answer `items`
too, and keep `data` (the same list) for one release, marked deprecated in the OpenAPI schema and in
CHANGELOG.md. A bottom module: pydantic only, so every domain's schemas may import it.
"""

from typing import Any

from pydantic import BaseModel, computed_field


class Listing(BaseModel):
    """Mix into a list's response model that declares `items`: adds the deprecated `data` alias."""

    items: list[Any]

    # NOTE: marked deprecated in the schema only: pydantic's deprecated= would warn at every response it writes.
    @computed_field(description="the same list as `items`, under its old name (deprecated: it goes in a later "
                    "release, CHANGELOG.md)", json_schema_extra={"deprecated": True})
    @property
    def data(self) -> list[Any]:
        return self.items
