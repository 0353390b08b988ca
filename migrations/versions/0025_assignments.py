"""assignments: the one scheduler's placements of queued jobs on workers and their devices (issue 42)

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

import service.db  # noqa: F401

revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
