"""metric_blocks: per-256-step summaries of each series, for thinning long series fast (backfilled)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 19:10:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

BLOCK_STEPS = 256  # service/metrics/blocks.py's, as of this revision


def upgrade() -> None:
    blocks = op.create_table(
        'metric_blocks',
        sa.Column('job_id', sa.String(length=32), nullable=False),
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
        sa.PrimaryKeyConstraint('job_id', 'name', 'block'),
    )
    backfill(op.get_bind(), blocks)


def backfill(conn, blocks: sa.Table) -> None:
    """Summaries of the points already stored, streamed in the order the API reads them (a step's latest
    attempt wins), written a thousand blocks at a time."""
    query = sa.text("SELECT job_id, name, step, value FROM metrics ORDER BY job_id, name, step, attempt, id")
    rows = conn.execute(query.execution_options(stream_results=True, yield_per=10_000))
    pending: list[dict] = []
    key, points = None, {}

    def flush_block() -> None:
        if points:
            ordered = sorted(points.items())
            low, high = min(ordered, key=lambda p: p[1]), max(ordered, key=lambda p: p[1])
            pending.append({"job_id": key[0], "name": key[1], "block": key[2], "points": len(ordered),
                            "last_step": ordered[-1][0], "last_value": ordered[-1][1], "min_step": low[0],
                            "min_value": low[1], "max_step": high[0], "max_value": high[1]})
        if len(pending) >= 1000:
            conn.execute(blocks.insert(), pending)
            pending.clear()

    for job_id, name, step, value in rows:
        this = (job_id, name, step // BLOCK_STEPS)
        if this != key:
            flush_block()
            key, points = this, {}
        points[step] = value
    flush_block()
    if pending:
        conn.execute(blocks.insert(), pending)


def downgrade() -> None:
    op.drop_table('metric_blocks')
