"""Jobs per status and priority without counting the jobs table: counts kept as jobs change.

Triggers on jobs (migrations/versions/0012) append a +1 / -1 delta per row inserted, deleted or moved, in the
writer's own transaction; compact() folds them into job_counts (the sweeper, each pass). A read sums the two
in one statement, so it is exact for the committed rows whenever it runs, and costs the ~20 count rows plus
the deltas since the last pass, whatever the number of jobs.
"""

from sqlalchemy import func, select, text, union_all
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


def compact(db: Session) -> None:
    """Fold the deltas into job_counts. The caller commits."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(POSTGRES_COMPACT)
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
