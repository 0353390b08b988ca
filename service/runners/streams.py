"""What a worker's batches have done to the database: the last sequence number applied per attempt node and
stream (issue 42, docs/architecture.md "The worker protocol"), so a batch sent again (a retry after a lost answer,
an API restart, another replica) is acknowledged and not applied twice."""

from sqlalchemy import ForeignKey, Integer, String, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Mapped, Session, mapped_column

from service.db import Base

SHIP, EVENTS = "ship", "events"  # an attempt node's streams: its shipped batches, its job events


class AttemptStream(Base):
    __tablename__ = "attempt_streams"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    stream: Mapped[str] = mapped_column(String(16), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer)


def advance(db: Session, *, job_id: str, attempt: int, node_rank: int, stream: str, seq: int) -> bool:
    """Record `seq` as the stream's last applied batch, in the caller's transaction; False (nothing changed) when
    it is not past the stored one: that batch was applied already.

    An update where the stored one is lower, else an insert that does nothing on conflict: on PostgreSQL a replay
    racing its first send (two replicas) waits on the row's lock and then finds it done, on either path.
    """
    key = (AttemptStream.job_id == job_id, AttemptStream.attempt == attempt, AttemptStream.node_rank == node_rank,
           AttemptStream.stream == stream)
    if db.execute(update(AttemptStream).where(*key, AttemptStream.seq < seq).values(seq=seq)).rowcount:
        return True
    insert = pg_insert if db.get_bind().dialect.name == "postgresql" else sqlite_insert
    # NOTE: RETURNING, not rowcount: an INSERT's rowcount is -1 under psycopg 3 through SQLAlchemy.
    return db.execute(insert(AttemptStream).values(job_id=job_id, attempt=attempt, node_rank=node_rank, stream=stream,
                                                   seq=seq).on_conflict_do_nothing().returning(AttemptStream.seq)
                      ).first() is not None


def last(db: Session, *, job_id: str, attempt: int, node_rank: int, stream: str) -> int:
    """The stream's last applied sequence number (0: none yet)."""
    return db.scalar(select(AttemptStream.seq).where(
        AttemptStream.job_id == job_id, AttemptStream.attempt == attempt, AttemptStream.node_rank == node_rank,
        AttemptStream.stream == stream)) or 0


Key = tuple[str, int, int, str]  # (job_id, attempt, node_rank, stream)


def advance_many(db: Session, batches: list[tuple[str, int, int, str, int]]) -> set[Key]:
    """advance() of several streams in one statement, each (job_id, attempt, node_rank, stream, seq) and each stream
    once: the keys whose seq was recorded (the others were applied before).

    An upsert that updates only where the stored seq is lower, RETURNING the rows it wrote (PostgreSQL; SQLite
    >= 3.35): a conflict whose WHERE fails returns nothing. On PostgreSQL a replay racing its first send waits on the
    row's lock, as advance's does, and then finds it done.
    """
    if not batches:
        return set()
    insert = pg_insert if db.get_bind().dialect.name == "postgresql" else sqlite_insert
    upsert = insert(AttemptStream).values([
        {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "stream": stream, "seq": seq}
        for job_id, attempt, node_rank, stream, seq in batches])
    upsert = upsert.on_conflict_do_update(
        index_elements=["job_id", "attempt", "node_rank", "stream"], set_={"seq": upsert.excluded.seq},
        where=AttemptStream.seq < upsert.excluded.seq)
    return {tuple(row) for row in db.execute(upsert.returning(
        AttemptStream.job_id, AttemptStream.attempt, AttemptStream.node_rank, AttemptStream.stream))}
