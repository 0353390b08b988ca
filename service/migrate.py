"""Run Alembic migrations from code (`trainjobs db upgrade`, `trainjobs up`, tests)."""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

import migrations
from service.db import make_private_sqlite


def alembic_config(url: str) -> Config:
    config = Config(str(Path(migrations.__file__).parent / "alembic.ini"))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    make_private_sqlite(url)  # 0600 before the first connection makes it
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The revision the database is at (None: not migrated at all)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
