"""metrics.job_id without its foreign key to jobs: the per-row check was ~40% of the database's CPU a point

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-07 12:40:00.000000

Every point written ran the key's check (`SELECT 1 FROM jobs WHERE id = $1 FOR KEY SHARE`, one a row), 6-9 µs
of PostgreSQL's ~14-18 µs a point under COPY (bench/README.md "Metric ingest through the worker API"). Points
are written only by a ship fenced on its attempt holding the job (lifecycle.still_held, same transaction), and
the service never deletes a job (retention keeps the row and deletes its points), so the key guarded nothing a
write could break. The downgrade deletes orphaned points first, then puts the key back.
"""

from alembic import op

revision = '0027'
down_revision = '0026'
branch_labels = None
depends_on = None

KEY = "metrics_job_id_fkey"  # PostgreSQL's name for it; SQLite's is unnamed, named by the convention below
SQLITE_NAMES = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(KEY, "metrics", type_="foreignkey")
        return
    with op.batch_alter_table("metrics", naming_convention=SQLITE_NAMES) as batch:
        batch.drop_constraint("fk_metrics_job_id_jobs", type_="foreignkey")


def downgrade() -> None:
    op.execute("DELETE FROM metrics WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.id = metrics.job_id)")
    if op.get_bind().dialect.name == "postgresql":
        op.create_foreign_key(KEY, "metrics", "jobs", ["job_id"], ["id"], ondelete="CASCADE")
        return
    with op.batch_alter_table("metrics") as batch:
        batch.create_foreign_key("fk_metrics_job_id_jobs", "jobs", ["job_id"], ["id"], ondelete="CASCADE")
