"""attempt_streams: the last sequence number applied per attempt node and stream, so a batch a worker sends again is acknowledged and not applied twice (issue 42)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'attempt_streams',
        sa.Column('job_id', sa.String(32), sa.ForeignKey('jobs.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('attempt', sa.Integer(), primary_key=True),
        sa.Column('node_rank', sa.Integer(), primary_key=True),
        sa.Column('stream', sa.String(16), primary_key=True),
        sa.Column('seq', sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('attempt_streams')
