"""jobs.collected_at: when retention deleted a job's rows, folder and stored objects, so a run skips it

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06 21:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

UNCOLLECTED = "collected_at IS NULL AND finished_at IS NOT NULL"


def upgrade() -> None:
    # NOTE: a plain ADD COLUMN, never a batch (copy-and-move) on SQLite: it would lose the jobs table's triggers.
    op.add_column('jobs', sa.Column('collected_at', service.db.UTCDateTime(timezone=True), nullable=True))
    op.create_index('ix_jobs_uncollected', 'jobs', ['id'], postgresql_where=sa.text(UNCOLLECTED),
                    sqlite_where=sa.text(UNCOLLECTED))


def downgrade() -> None:
    op.drop_index('ix_jobs_uncollected', table_name='jobs')
    if op.get_bind().dialect.name == "sqlite":  # SQLite 3.35+ drops a plain column in place (no batch: triggers)
        op.execute("ALTER TABLE jobs DROP COLUMN collected_at")
    else:
        op.drop_column('jobs', 'collected_at')
