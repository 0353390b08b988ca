"""packages: working directories uploaded with jobs, per owner and content digest

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 18:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'packages',
        sa.Column('owner', sa.String(length=64), nullable=False),
        sa.Column('digest', sa.String(length=71), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('files', sa.Integer(), nullable=False),
        sa.Column('unpacked_bytes', sa.BigInteger(), nullable=False),
        sa.Column('created_at', service.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('owner', 'digest'),
    )


def downgrade() -> None:
    op.drop_table('packages')
