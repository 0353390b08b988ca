"""sweeps (issue 17), and on jobs: sweep_id, sweep_trial, sweep_params, reason

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 03:30:00.000000

New nullable columns only (no rewrite of jobs). The unique index (sweep_id, sweep_trial) is built on a table where
every job has NULLs there, which both databases keep distinct: old jobs never collide.
"""

import sqlalchemy as sa
from alembic import op

from service.db import UTCDateTime

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None
JOB_COLUMNS = ("sweep_id", "sweep_trial", "sweep_params", "reason")


def upgrade() -> None:
    op.create_table(
        'sweeps',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('owner', sa.String(length=128), nullable=False),
        sa.Column('role', sa.String(length=16), nullable=False),
        sa.Column('can_run_entrypoints', sa.Boolean(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('config', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('created_at', UTCDateTime(timezone=True), nullable=False),
        sa.Column('finished_at', UTCDateTime(timezone=True), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_sweeps_owner_id', 'sweeps', ['owner', 'id'])
    op.create_index('ix_sweeps_status', 'sweeps', ['status'])
    op.add_column('jobs', sa.Column('sweep_id', sa.String(length=32), nullable=True))
    op.add_column('jobs', sa.Column('sweep_trial', sa.Integer(), nullable=True))
    op.add_column('jobs', sa.Column('sweep_params', sa.JSON(none_as_null=True), nullable=True))
    op.add_column('jobs', sa.Column('reason', sa.String(length=32), nullable=True))
    op.create_index('ix_jobs_sweep_trial', 'jobs', ['sweep_id', 'sweep_trial'], unique=True)


def downgrade() -> None:
    op.drop_index('ix_jobs_sweep_trial', table_name='jobs')
    for column in JOB_COLUMNS:
        if op.get_bind().dialect.name == "sqlite":  # in place: a batch copy of jobs would cascade (see 0010)
            op.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        else:
            op.drop_column('jobs', column)
    op.drop_index('ix_sweeps_status', table_name='sweeps')
    op.drop_index('ix_sweeps_owner_id', table_name='sweeps')
    op.drop_table('sweeps')
