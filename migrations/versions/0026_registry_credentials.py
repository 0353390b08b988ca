"""registry_credentials: a user's or a team's login to a container registry, for its jobs' images (issue 44)

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'registry_credentials',
        sa.Column('scope', sa.String(8), primary_key=True),
        sa.Column('owner', sa.String(64), primary_key=True),
        sa.Column('registry', sa.String(255), primary_key=True),
        sa.Column('username', sa.String(255), nullable=False),
        sa.Column('sealed', sa.LargeBinary(), nullable=False),
        sa.Column('set_by', sa.String(64), nullable=False),
        sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('updated_at', service.db.UTCDateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('registry_credentials')
