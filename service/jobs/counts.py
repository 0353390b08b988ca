"""Jobs per status and priority without counting the jobs table: counts kept as jobs change.

Triggers on jobs (migrations/versions/0012) append a +1 / -1 delta per row inserted, deleted or moved, in the
writer's own transaction; compact() folds them into job_counts (the sweeper, each pass). A read sums the two
in one statement, so it is exact for the committed rows whenever it runs, and costs the ~20 count rows plus
the deltas since the last pass, whatever the number of jobs.
"""

import logging

from sqlalchemy import func, select, text, union_all
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from service.jobs.models import JobCount, JobCountDelta

# One statement on PostgreSQL: the deltas it deletes are the ones it adds, whatever commits meanwhile, and two
# compactions at once each move their own rows (ORDER BY: they take the count rows in the same order).
POSTGRES_COMPACT = text("""
WITH moved AS (DELETE FROM job_count_deltas RETURNING status, priority, n)
INSERT INTO job_counts (status, priority, n)
SELECT status, priority, sum(n) FROM moved GROUP BY status, priority ORDER BY status, priority
ON CONFLICT (status, priority) DO UPDATE SET n = job_counts.n + EXCLUDED.n
""")
# SQLite has one writer: from the first statement on, no delta commits before this transaction does.
SQLITE_COMPACT = [text("""
INSERT INTO job_counts (status, priority, n)
SELECT status, priority, sum(n) FROM job_count_deltas WHERE true GROUP BY status, priority
ON CONFLICT (status, priority) DO UPDATE SET n = job_counts.n + excluded.n
"""), text("DELETE FROM job_count_deltas")]


log = logging.getLogger(__name__)
# NOTE: a burst (a million jobs loaded in a minute) leaves the deltas' table as large as its peak: vacuum
# reuses the space but seldom gives it back, and every read scans it. Past this size it is emptied at once.
BLOATED_BYTES = 1 << 20


def compact(db: Session) -> None:
    """Fold the deltas into job_counts (and, on PostgreSQL, empty a bloated table of them). The caller commits."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(POSTGRES_COMPACT)
        if db.scalar(text("SELECT pg_relation_size('job_count_deltas')")) > BLOATED_BYTES:
            shrink(db)
    else:
        for statement in SQLITE_COMPACT:
            db.execute(statement)


def by_status_and_priority(db: Session) -> dict[tuple[str, str], int]:
    """(status, priority) → jobs, as committed."""
    both = union_all(select(JobCount.status, JobCount.priority, JobCount.n),
                     select(JobCountDelta.status, JobCountDelta.priority, JobCountDelta.n)).subquery()
    rows = db.execute(select(both.c.status, both.c.priority, func.sum(both.c.n))
                      .group_by(both.c.status, both.c.priority)).all()
    return {(status, priority): int(n) for status, priority, n in rows}


def shrink(db: Session) -> bool:
    """TRUNCATE the deltas' table after a last fold, if no writer holds it now (NOWAIT: never a wait, and a
    writer that comes meanwhile waits for this short transaction only). False when it did not."""
    try:
        with db.begin_nested():
            db.execute(text("LOCK TABLE job_count_deltas IN ACCESS EXCLUSIVE MODE NOWAIT"))
            db.execute(POSTGRES_COMPACT)  # what committed since the first fold
            db.execute(text("TRUNCATE job_count_deltas"))
    except OperationalError:
        log.info("the job count deltas' table is busy; it is emptied at a later pass")
        return False
    return True
