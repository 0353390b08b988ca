"""Workers say why they take no jobs while they run: disk pressure (a storage or run dir below its free space)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 12:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        batch.add_column(sa.Column('pressure', sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        batch.drop_column('pressure')
