"""assignments: the one scheduler's placements of queued jobs on workers and their devices (issue 42)

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07 09:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'assignments',
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('node_rank', sa.Integer(), nullable=False),
        sa.Column('worker_id', sa.String(length=256), nullable=False),
        sa.Column('devices', sa.JSON(none_as_null=True), nullable=True),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('pass_no', sa.BigInteger(), nullable=False),
        sa.Column('assigned_at', service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('taken_at', service.db.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('job_id', 'node_rank', name='pk_assignments'),
    )
    op.create_index('ix_assignments_worker', 'assignments', ['worker_id'])


def downgrade() -> None:
    op.drop_index('ix_assignments_worker', table_name='assignments')
    op.drop_table('assignments')
