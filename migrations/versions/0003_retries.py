"""retries: when a requeued job may run again, and where each attempt resumed from

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 16:40:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot alter tables in place; on PostgreSQL it is a plain ALTER TABLE.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('not_before', service.db.UTCDateTime(), nullable=True))
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resumed_from_step', sa.Integer(), nullable=True))
        batch_op.create_index('ix_attempts_status_lease', ['status', 'lease_expires_at'])


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index('ix_attempts_status_lease')
        batch_op.drop_column('resumed_from_step')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('not_before')
