"""users.multinode: the right to run a multi-node gang, whose ranks share their hosts' network (issue 41)

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 06:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Off for every user, old ones too: a security reviewer's default (admins keep it by role; an operator may give
    # it to all with TRAINJOBS_MULTINODE_FOR_ALL).
    op.add_column('users', sa.Column('multinode', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # in place, as 0021: no batch copy
        op.execute("ALTER TABLE users DROP COLUMN multinode")
    else:
        op.drop_column('users', 'multinode')
