"""job_tags (a job's spec.tags, one row each: the list filters by tag with an index) and jobs.cloned_from

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 01:00:00.000000

The backfill reads every job's spec once, in batches of 5,000 (at a million jobs, about a minute).
"""

import json

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None
BATCH = 5000


def upgrade() -> None:
    op.create_table(
        'job_tags',
        sa.Column('job_id', sa.String(length=32), sa.ForeignKey('jobs.id', ondelete='CASCADE'), nullable=False),
        sa.Column('tag', sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'tag'),
    )
    op.create_index('ix_job_tags_tag_job', 'job_tags', ['tag', 'job_id'])
    op.add_column('jobs', sa.Column('cloned_from', sa.String(length=32), nullable=True))
    bind = op.get_bind()
    jobs, tags = sa.table('jobs', sa.column('id'), sa.column('spec')), sa.table('job_tags', sa.column('job_id'),
                                                                                sa.column('tag'))
    after = ""
    while rows := bind.execute(sa.select(jobs.c.id, jobs.c.spec).where(jobs.c.id > after)
                               .order_by(jobs.c.id).limit(BATCH)).all():
        found = []
        for job_id, spec in rows:
            spec = json.loads(spec) if isinstance(spec, str) else spec
            found += [{"job_id": job_id, "tag": t} for t in dict.fromkeys((spec or {}).get("tags") or [])]
        if found:
            bind.execute(tags.insert(), found)
        after = rows[-1][0]


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":  # in place: a batch copy of jobs would cascade (see 0010)
        op.execute("ALTER TABLE jobs DROP COLUMN cloned_from")
    else:
        op.drop_column('jobs', 'cloned_from')
    op.drop_index('ix_job_tags_tag_job', table_name='job_tags')
    op.drop_table('job_tags')
