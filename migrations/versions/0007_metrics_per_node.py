"""metrics per node: metrics.node_rank (indexed with the step, and with the id for the event stream's cursor),
and metric_blocks keyed by node (rebuilt from the points)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 22:40:00.000000

Every point stored before this revision came from one reporter, the one global rank 0 ran: it becomes node 0's.
metric_blocks is derived from the points, so it is dropped and built again with the node in its key, as 0006
built it.
"""

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def _revision_0006():
    spec = importlib.util.spec_from_file_location("revision_0006", Path(__file__).with_name("0006_metric_blocks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks_table() -> sa.Table:
    return op.create_table(
        'metric_blocks',
        sa.Column('job_id', sa.String(length=32), nullable=False),
        sa.Column('node_rank', sa.Integer(), server_default='0', nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('block', sa.Integer(), nullable=False),
        sa.Column('points', sa.Integer(), nullable=False),
        sa.Column('last_step', sa.Integer(), nullable=False),
        sa.Column('last_value', sa.Float(), nullable=False),
        sa.Column('min_step', sa.Integer(), nullable=False),
        sa.Column('min_value', sa.Float(), nullable=False),
        sa.Column('max_step', sa.Integer(), nullable=False),
        sa.Column('max_value', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'node_rank', 'name', 'block'),
    )


def upgrade() -> None:
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.add_column(sa.Column('node_rank', sa.Integer(), server_default='0', nullable=False))
        batch_op.drop_index('ix_metrics_job_name_step')
        batch_op.create_index('ix_metrics_job_node_name_step', ['job_id', 'node_rank', 'name', 'step'])
        batch_op.create_index('ix_metrics_job_node_id', ['job_id', 'node_rank', 'id'])
    op.drop_table('metric_blocks')
    _revision_0006().backfill(op.get_bind(), _blocks_table())  # every point is node 0's


def downgrade() -> None:
    op.execute("DELETE FROM metrics WHERE node_rank <> 0")  # the other nodes' series have nowhere to go
    with op.batch_alter_table('metrics', schema=None) as batch_op:
        batch_op.drop_index('ix_metrics_job_node_id')
        batch_op.drop_index('ix_metrics_job_node_name_step')
        batch_op.create_index('ix_metrics_job_name_step', ['job_id', 'name', 'step'])
        batch_op.drop_column('node_rank')
    op.drop_table('metric_blocks')
    _revision_0006().upgrade()  # the table as 0006 made it, built again from the points
