"""jobs.version: a row version the database bumps on every UPDATE of a job, the ETag of its reads

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 23:50:00.000000

A trigger rather than `version = version + 1` in each UPDATE: every writer (the API, the sweeper, the worker,
a hand-run fix) bumps it, and none can forget to. Adding a NOT NULL column with a constant default is
instant on PostgreSQL 11+ (no table rewrite).
"""

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

POSTGRES_FUNCTION = """
CREATE FUNCTION jobs_bump_version() RETURNS trigger AS $$
BEGIN
    NEW.version := OLD.version + 1;
    RETURN NEW;
END
$$ LANGUAGE plpgsql
"""
POSTGRES_TRIGGER = ("CREATE TRIGGER jobs_version BEFORE UPDATE ON jobs "
                    "FOR EACH ROW EXECUTE FUNCTION jobs_bump_version()")
# SQLite cannot assign NEW: a second UPDATE, which fires no trigger again (recursive_triggers is off).
SQLITE_TRIGGER = """
CREATE TRIGGER jobs_version AFTER UPDATE ON jobs FOR EACH ROW
BEGIN
    UPDATE jobs SET version = OLD.version + 1 WHERE id = NEW.id;
END
"""


def upgrade() -> None:
    op.add_column('jobs', sa.Column('version', sa.Integer(), server_default='1', nullable=False))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
    else:
        op.execute(SQLITE_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER jobs_version ON jobs")
        op.execute("DROP FUNCTION jobs_bump_version()")
    else:
        op.execute("DROP TRIGGER jobs_version")
    # NOTE: not a batch (copy and rename) on SQLite: dropping the old jobs table would cascade to every
    # job's metrics, logs and events. SQLite drops a plain column in place since 3.35.
    op.execute("ALTER TABLE jobs DROP COLUMN version")
