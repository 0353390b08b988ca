"""workers: the workers table, why a queued job waits, and a gang's rendezvous endpoint

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 19:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'workers',
        sa.Column('id', sa.String(length=256), nullable=False),
        sa.Column('host', sa.String(length=256), nullable=False),
        sa.Column('address', sa.String(length=256), nullable=False),
        sa.Column('device', sa.String(length=8), nullable=False),
        sa.Column('slots', sa.Integer(), nullable=False),
        sa.Column('busy_slots', sa.Integer(), nullable=False),
        sa.Column('memory_bytes', sa.BigInteger(), nullable=True),
        sa.Column('host_memory_bytes', sa.BigInteger(), nullable=True),
        sa.Column('labels', sa.JSON(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('current_job', sa.String(length=32), nullable=True),
        sa.Column('started_at', service.db.UTCDateTime(), nullable=False),
        sa.Column('last_seen', service.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_workers_last_seen', 'workers', ['last_seen'])
    # batch mode: SQLite cannot alter tables in place; on PostgreSQL it is a plain ALTER TABLE.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pending_reason', sa.Text(), nullable=True))
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('endpoint', sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('endpoint')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('pending_reason')
    op.drop_index('ix_workers_last_seen', table_name='workers')
    op.drop_table('workers')
