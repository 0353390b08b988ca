"""job_counts and job_count_deltas: jobs per status and priority kept as they change, so /metrics never
counts the jobs table

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 00:00:00.000000

Triggers on jobs append a +1 / -1 delta for every row inserted, deleted, or moved to another status or
priority (in the writer's transaction: the count is exactly the committed rows'); the sweeper folds the
deltas into job_counts (service/jobs/counts.py). Appending, not updating a counter row, so concurrent
writers never queue on one row or deadlock on two.

The upgrade counts the jobs stored (under a lock that holds writers off, on PostgreSQL: a pause of about
a second per million jobs).
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

POSTGRES_FUNCTION = """
CREATE FUNCTION jobs_count_delta() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.status = NEW.status AND OLD.priority = NEW.priority THEN
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        INSERT INTO job_count_deltas (status, priority, n) VALUES (OLD.status, OLD.priority, -1);
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        INSERT INTO job_count_deltas (status, priority, n) VALUES (NEW.status, NEW.priority, 1);
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql
"""
POSTGRES_TRIGGER = ("CREATE TRIGGER jobs_count AFTER INSERT OR DELETE OR UPDATE OF status, priority ON jobs "
                    "FOR EACH ROW EXECUTE FUNCTION jobs_count_delta()")
SQLITE_TRIGGERS = [
    """CREATE TRIGGER jobs_count_insert AFTER INSERT ON jobs FOR EACH ROW BEGIN
        INSERT INTO job_count_deltas (status, priority, n) VALUES (NEW.status, NEW.priority, 1);
    END""",
    """CREATE TRIGGER jobs_count_delete AFTER DELETE ON jobs FOR EACH ROW BEGIN
        INSERT INTO job_count_deltas (status, priority, n) VALUES (OLD.status, OLD.priority, -1);
    END""",
    """CREATE TRIGGER jobs_count_update AFTER UPDATE OF status, priority ON jobs FOR EACH ROW
    WHEN OLD.status IS NOT NEW.status OR OLD.priority IS NOT NEW.priority BEGIN
        INSERT INTO job_count_deltas (status, priority, n) VALUES (OLD.status, OLD.priority, -1),
                                                                  (NEW.status, NEW.priority, 1);
    END""",
]


def upgrade() -> None:
    op.create_table(
        'job_counts',
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('priority', sa.String(length=8), nullable=False),
        sa.Column('n', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('status', 'priority'),
    )
    op.create_table(
        'job_count_deltas',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('priority', sa.String(length=8), nullable=False),
        sa.Column('n', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE")  # no write between the count and the trigger
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
    else:
        for trigger in SQLITE_TRIGGERS:
            op.execute(trigger)
    op.execute("INSERT INTO job_counts (status, priority, n) SELECT status, priority, count(*) FROM jobs "
               "GROUP BY status, priority")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER jobs_count ON jobs")
        op.execute("DROP FUNCTION jobs_count_delta()")
    else:
        for name in ("jobs_count_insert", "jobs_count_delete", "jobs_count_update"):
            op.execute(f"DROP TRIGGER {name}")
    op.drop_table('job_count_deltas')
    op.drop_table('job_counts')
