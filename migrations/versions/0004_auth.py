"""auth: users and their API tokens (hashed)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 19:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

import service.db

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'users',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('can_run_entrypoints', sa.Boolean(), nullable=False),
        sa.Column('created_at', service.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )
    op.create_table(
        'api_tokens',
        sa.Column('id', sa.String(length=32), nullable=False),
        sa.Column('user', sa.String(length=64), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('role', sa.String(length=8), nullable=False),
        sa.Column('token_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', service.db.UTCDateTime(), nullable=False),
        sa.Column('last_used_at', service.db.UTCDateTime(), nullable=True),
        sa.Column('expires_at', service.db.UTCDateTime(), nullable=True),
        sa.Column('revoked_at', service.db.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(['user'], ['users.name'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('token_hash'),
    )
    op.create_index('ix_api_tokens_user', 'api_tokens', ['user'])


def downgrade() -> None:
    op.drop_index('ix_api_tokens_user', table_name='api_tokens')
    op.drop_table('api_tokens')
    op.drop_table('users')
