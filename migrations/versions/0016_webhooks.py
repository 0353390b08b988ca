"""webhooks and webhook_deliveries (the outbox: one row per event per webhook, written with the change it reports)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 03:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

from service.db import UTCDateTime

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'webhooks',
        sa.Column('id', sa.String(length=32), primary_key=True),
        sa.Column('owner', sa.String(length=64), nullable=False),
        sa.Column('all_users', sa.Boolean(), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('events', sa.JSON(), nullable=False),
        sa.Column('format', sa.String(length=8), nullable=False),
        sa.Column('secret', sa.String(length=256), nullable=False),
        sa.Column('created_at', UTCDateTime(), nullable=False),
    )
    op.create_index('ix_webhooks_owner', 'webhooks', ['owner'])
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True, autoincrement=True),
        sa.Column('webhook_id', sa.String(length=32), sa.ForeignKey('webhooks.id', ondelete='CASCADE'),
                  nullable=False),
        sa.Column('event_id', sa.String(length=32), nullable=False),
        sa.Column('event', sa.String(length=32), nullable=False),
        sa.Column('subject', sa.String(length=64), nullable=False),
        sa.Column('payload', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('created_at', UTCDateTime(), nullable=False),
        sa.Column('next_attempt_at', UTCDateTime(), nullable=False),
        sa.Column('claimed_by', sa.String(length=64), nullable=True),
        sa.Column('claimed_until', UTCDateTime(), nullable=True),
        sa.Column('last_attempt_at', UTCDateTime(), nullable=True),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('last_response', sa.Text(), nullable=True),
        sa.Column('delivered_at', UTCDateTime(), nullable=True),
        sa.Column('tries', sa.JSON(), nullable=True),
    )
    op.create_index('ix_webhook_deliveries_status_due', 'webhook_deliveries', ['status', 'next_attempt_at'])
    op.create_index('ix_webhook_deliveries_order', 'webhook_deliveries', ['webhook_id', 'subject', 'id'])
    op.create_index('ix_webhook_deliveries_webhook_id', 'webhook_deliveries', ['webhook_id', 'id'])


def downgrade() -> None:
    op.drop_table('webhook_deliveries')
    op.drop_table('webhooks')
