"""registry_credentials: a user's or a team's login to a container registry, for its jobs' images (issue 44)

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

import service.db  # noqa: F401

revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
