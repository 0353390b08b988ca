"""jobs: indexes for a user's own jobs, newest first (all of them, or of one status)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 00:10:00.000000

Without them a user's list walked the primary key backwards filtering on owner: quick for an owner with many
recent jobs, the whole table for one with few (EXPLAIN at 1M jobs: bench/README.md). On PostgreSQL they are
built CONCURRENTLY, outside the migration's transaction: submissions and workers go on meanwhile.
"""

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

INDEXES = {"ix_jobs_owner_id": ["owner", "id"], "ix_jobs_owner_status_id": ["owner", "status", "id"]}


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.get_context().autocommit_block():
        for name, columns in INDEXES.items():
            op.create_index(name, "jobs", columns, postgresql_concurrently=postgres, if_not_exists=True)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="jobs")
