"""worker_join_tokens, worker_credentials, workers.runner: a machine joins the pool with a credential of its own,
not the database's (issue 42)

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07 06:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'worker_join_tokens',
        sa.Column('id', sa.String(32), primary_key=True),
        sa.Column('token_hash', sa.String(64), nullable=False, unique=True),
        sa.Column('created_by', sa.String(64), nullable=False),
        sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('expires_at', service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column('uses_left', sa.Integer(), nullable=True),
        sa.Column('revoked_at', service.db.UTCDateTime(timezone=True), nullable=True),
    )
    op.create_table(
        'worker_credentials',
        sa.Column('id', sa.String(32), primary_key=True),
        sa.Column('runner', sa.String(128), nullable=False),
        sa.Column('token_hash', sa.String(64), nullable=False, unique=True),
        sa.Column('join_token', sa.String(32), nullable=True),
        sa.Column('created_at', service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('last_used_at', service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column('revoked_at', service.db.UTCDateTime(timezone=True), nullable=True),
    )
    op.create_index('ix_worker_credentials_runner', 'worker_credentials', ['runner'])
    op.add_column('workers', sa.Column('runner', sa.String(128), nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # in place, as 0021: no batch copy
        op.execute("ALTER TABLE workers DROP COLUMN runner")
    else:
        op.drop_column('workers', 'runner')
    op.drop_index('ix_worker_credentials_runner', 'worker_credentials')
    op.drop_table('worker_credentials')
    op.drop_table('worker_join_tokens')
