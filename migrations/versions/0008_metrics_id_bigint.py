"""metrics.id is 64-bit on PostgreSQL (BIGINT, and its sequence too): 2^31 points in a deployment's life is not
the end of shipping

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 09:10:00.000000

SQLite needs nothing: its INTEGER PRIMARY KEY is the 64-bit rowid already. On PostgreSQL the column's type change
rewrites the table (and its indexes) under an exclusive lock: expect a pause proportional to the points stored.
A serial column's sequence is typed too (AS integer, its maximum 2^31 - 1), so it is widened with the column.
The downgrade narrows both again (the sequence restarting after the largest id kept) and fails, changing nothing,
while an id past 2^31 - 1 is stored.
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column('metrics', 'id', type_=sa.BigInteger(), existing_type=sa.Integer(), existing_nullable=False)
    op.execute("ALTER SEQUENCE metrics_id_seq AS bigint")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column('metrics', 'id', type_=sa.Integer(), existing_type=sa.BigInteger(), existing_nullable=False)
    # A sequence past 2^31 - 1 cannot become an integer one: restart it after the largest id kept.
    op.execute("SELECT setval('metrics_id_seq', (SELECT COALESCE(MAX(id), 0) + 1 FROM metrics), false)")
    op.execute("ALTER SEQUENCE metrics_id_seq AS integer")
