"""Alembic's migrations build exactly the schema the models describe, on both databases."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from service import migrate
from service.models import Base


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migrations_match_the_models(request, backend):
    url = request.getfixturevalue(f"{backend}_url")
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


def test_upgrade_is_idempotent(sqlite_url):
    migrate.upgrade(sqlite_url)  # already at head: nothing to do, nothing fails
