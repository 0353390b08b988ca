"""stacks: every rank's stack dump on the attempt (a hang, or asked for), the job's pending request for one, and
the job's warnings (a straggler named)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 00:10:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('attempts', sa.Column('stacks', sa.JSON(none_as_null=True), nullable=True))
    op.add_column('jobs', sa.Column('stacks_requested_at', service.db.UTCDateTime(), nullable=True))
    op.add_column('jobs', sa.Column('warnings', sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    # NOTE: never a batch (copy-and-move) on SQLite here: dropping the old jobs table would cascade to every
    # job's attempts, logs and metrics. SQLite 3.35+ drops a plain column in place.
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN warnings")
        op.execute("ALTER TABLE jobs DROP COLUMN stacks_requested_at")
        op.execute("ALTER TABLE attempts DROP COLUMN stacks")
        return
    op.drop_column('jobs', 'warnings')
    op.drop_column('jobs', 'stacks_requested_at')
    op.drop_column('attempts', 'stacks')
