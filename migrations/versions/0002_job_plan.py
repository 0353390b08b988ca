"""job plan: the memory plan a job was submitted with

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 10:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot alter tables in place; on PostgreSQL it is a plain ALTER TABLE.
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('plan', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('plan')
