"""Run Alembic migrations from code (`trainjobs db upgrade`, `trainjobs up`, tests)."""

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations


def alembic_config(url: str) -> Config:
    config = Config(str(Path(migrations.__file__).parent / "alembic.ini"))
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
