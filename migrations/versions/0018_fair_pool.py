"""The fair pool: teams, users' team/weight/quota, owners' decayed usage, attempts charged to it, preemption asks

Revision ID: 0018
Revises: 0016
Create Date: 2026-12-04 04:00:00.000000

Attempts that closed before this revision are marked charged: the pool's usage starts from the upgrade, rather
than charging a history whose decay would make it count little anyway, in one pass over every attempt.
"""

import sqlalchemy as sa
from alembic import op

from service.db import UTCDateTime

revision = '0018'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'teams',
        sa.Column('name', sa.String(length=64), primary_key=True),
        sa.Column('weight', sa.Float(), nullable=False),
        sa.Column('max_slots', sa.Integer(), nullable=True),
        sa.Column('created_at', UTCDateTime(), nullable=False),
    )
    op.create_table(
        'usage',
        sa.Column('owner', sa.String(length=128), primary_key=True),
        sa.Column('device_seconds', sa.Float(), nullable=False),
        sa.Column('as_of', UTCDateTime(), nullable=False),
    )
    # NOTE: plain ADD COLUMNs, never a batch (copy-and-move) on SQLite: dropping the old jobs or users table would
    # cascade to their attempts, logs, metrics and tokens, and lose the jobs table's triggers.
    op.add_column('users', sa.Column('team', sa.String(length=64), nullable=True))
    op.add_column('users', sa.Column('weight', sa.Float(), nullable=False, server_default='1'))
    op.add_column('users', sa.Column('max_slots', sa.Integer(), nullable=True))
    op.create_index('ix_users_team', 'users', ['team'])
    op.add_column('jobs', sa.Column('preempt_requested_at', UTCDateTime(), nullable=True))
    op.add_column('jobs', sa.Column('preempt_detail', sa.Text(), nullable=True))
    op.add_column('attempts', sa.Column('charged', sa.Boolean(), nullable=False, server_default=sa.text('false')))
    op.execute("UPDATE attempts SET charged = true WHERE finished_at IS NOT NULL")
    op.create_index('ix_attempts_uncharged', 'attempts', ['finished_at'], postgresql_where=sa.text('NOT charged'),
                    sqlite_where=sa.text('NOT charged'))


def downgrade() -> None:
    op.drop_index('ix_attempts_uncharged', table_name='attempts')
    op.drop_index('ix_users_team', table_name='users')
    # SQLite 3.35+ drops a plain column in place (see 0010's downgrade: never a batch here).
    for table, column in (('attempts', 'charged'), ('jobs', 'preempt_detail'), ('jobs', 'preempt_requested_at'),
                          ('users', 'max_slots'), ('users', 'weight'), ('users', 'team')):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        else:
            op.drop_column(table, column)
    op.drop_table('usage')
    op.drop_table('teams')
