"""Append and read a job's log: one byte-addressed stream per node rank across attempts (node 0: the whole log
of a single-node job)."""

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from service.logs.models import LogChunk
from trainjobs.rank_output import rank_lines


def log_size(db: Session, *, job_id: str, node_rank: int = 0) -> tuple[int, int]:
    """(bytes stored so far, next seq) for the job's node."""
    end, seq = db.execute(
        select(func.max(LogChunk.start + LogChunk.length), func.max(LogChunk.seq))
        .where(LogChunk.job_id == job_id, LogChunk.node_rank == node_rank)
    ).one()
    return end or 0, (seq or 0) + 1


def append(db: Session, *, job_id: str, attempt: int, start: int, seq: int, text: str, node_rank: int = 0) -> int:
    """Store one chunk at byte offset `start`; returns its length in bytes."""
    length = len(text.encode())
    db.add(LogChunk(job_id=job_id, attempt=attempt, node_rank=node_rank, seq=seq, start=start,
                    length=length, text=text))
    return length


def append_many(db: Session, chunks: list[dict]) -> None:
    """Store several chunks in one INSERT, in their order (a worker's tick: one chunk of each node that shipped);
    each chunk holds append's arguments, the rows those appends would store."""
    if chunks:
        db.execute(insert(LogChunk).values([{**chunk, "length": len(chunk["text"].encode())} for chunk in chunks]))


def read(db: Session, *, job_id: str, offset: int = 0, node_rank: int = 0, rank: int | None = None,
         final: bool = True) -> tuple[bytes, int]:
    """The node's log from byte `offset` to the end, and the offset to ask for next.

    With `rank`: only that rank's lines (their `[rank<R>]: ` taken off) and the lines no rank marked
    (trainjobs/rank_output.py), and, unless `final` (the job has ended), only whole lines: the offset to ask for
    next is then the start of the line not ended yet, whose start says whose it is.
    """
    chunks = db.scalars(
        select(LogChunk)
        .where(LogChunk.job_id == job_id, LogChunk.node_rank == node_rank, LogChunk.start + LogChunk.length > offset)
        .order_by(LogChunk.start)
    ).all()
    if not chunks:
        return b"", max(offset, log_size(db, job_id=job_id, node_rank=node_rank)[0])
    data = b"".join(c.text.encode() for c in chunks)
    skip = max(0, offset - chunks[0].start)
    if rank is None:
        return data[skip:], chunks[-1].start + chunks[-1].length
    kept, used = rank_lines(data[skip:], rank, final=final)
    return kept, chunks[0].start + skip + used  # the chunks are contiguous: a node's log has no gaps
