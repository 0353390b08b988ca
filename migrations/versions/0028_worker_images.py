"""workers.images: the container images a worker has unpacked, so the scheduler's pass prefers it for a job that
names one (issue 44: a soft preference, never a wait)

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-07 13:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0028'
down_revision = '0027'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("images", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("images")
