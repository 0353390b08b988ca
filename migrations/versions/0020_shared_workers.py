"""Shared workers: a worker runs several jobs at once, each holding devices of its own (issue 30)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 15:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'holds',
        sa.Column('worker_id', sa.String(length=256), nullable=False),
        sa.Column('device', sa.Integer(), nullable=False),
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('node_rank', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=True),
        sa.Column('since', service.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('worker_id', 'device', name='pk_holds'),
    )
    op.create_index('ix_holds_job', 'holds', ['job_id'])
    # NOTE: plain ADD COLUMNs, never a batch (copy-and-move) on SQLite: it would lose the jobs table's triggers
    # and cascade (see 0010 and 0018).
    op.add_column('workers', sa.Column('max_jobs', sa.Integer(), server_default=sa.text('1'), nullable=False))
    op.add_column('workers', sa.Column('devices', sa.JSON(none_as_null=True), nullable=True))
    op.add_column('attempts', sa.Column('placement', sa.JSON(none_as_null=True), nullable=True))
    op.add_column('jobs', sa.Column('placement', sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    for table, column in (('jobs', 'placement'), ('attempts', 'placement'), ('workers', 'devices'),
                          ('workers', 'max_jobs')):
        if op.get_bind().dialect.name == "sqlite":  # SQLite 3.35+ drops a plain column in place
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        else:
            op.drop_column(table, column)
    op.drop_index('ix_holds_job', table_name='holds')
    op.drop_table('holds')
