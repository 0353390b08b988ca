"""Move what a run writes (output, metric lines) into the database in batches."""

import codecs
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.orm import Session

from service.logs import service as logs
from service.metrics import service as metrics
from trainjobs.runenv import parse_record
from worker.redact import Redactor

RANK_SERIES = "step_time_s/rank"  # worker/train/own_time.py's (not imported: it loads torch)
NUL, REPLACEMENT = "\x00", "\ufffd"  # PostgreSQL stores no NUL in text; U+FFFD is what a decoder shows for bad bytes


def storable_text(text: str) -> str:
    """Text any database stores: NUL and lone surrogates (json.loads makes them from "\\ud800") replaced."""
    return text.replace(NUL, REPLACEMENT).encode("utf-8", "replace").decode()


def storable_json(value):
    """A record's JSON with non-finite floats as null and text storable: a summary's NaN breaks strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(str(k)): storable_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable_json(v) for v in value]
    return value


PUMP_MAX_PENDING = 8 * 2**20  # bytes an OutputPump holds untaken; past it the oldest go, so the tail survives
READ_BYTES = 65536
UTF8_CONTINUATION = range(0x80, 0xC0)


def dropped_marker(dropped: int) -> bytes:
    return f"\n[trainjobs] {dropped} bytes of output dropped while the log could not keep up\n".encode()


class OutputPump:
    """Reads torchrun's merged stdout/stderr on a thread, so the pipe never fills and blocks training.

    It holds at most `max_pending` bytes untaken (plus one read): a burst of output or a stalled database
    never grows the worker's memory past that. Past the bound the oldest bytes go, so the newest (a traceback)
    survive; take() then starts with a line saying how many were dropped.
    """

    def __init__(self, fd: int, *, max_pending: int = PUMP_MAX_PENDING):
        # Its own copy of the pipe's end: should it be given up on (wait_closed), the caller may close the
        # original, and the reader never reads a number that now names another file.
        self._fd, self._lock, self.max_pending = os.dup(fd), threading.Lock(), max_pending
        self._chunks: deque[bytes] = deque()  # chunks, not one bytearray: dropping the oldest moves no bytes
        self._size, self._dropped = 0, 0
        self._thread = threading.Thread(target=self._read, name="output-pump", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while data := os.read(self._fd, READ_BYTES):
                with self._lock:
                    self._chunks.append(data)
                    self._size += len(data)
                    self._drop_oldest(self._size - self.max_pending)
        finally:
            os.close(self._fd)

    def _drop_oldest(self, excess: int) -> None:
        """Drop `excess` bytes from the front, and the rest of a UTF-8 character they cut into."""
        while excess > 0 or (self._dropped and self._chunks and self._chunks[0][0] in UTF8_CONTINUATION):
            first = self._chunks[0]
            n = len(first) if excess >= len(first) else max(excess, 1)
            if n == len(first):
                self._chunks.popleft()
            else:
                self._chunks[0] = first[n:]
            self._size, self._dropped, excess = self._size - n, self._dropped + n, excess - n

    def wait_closed(self, give_up_s: float, every_s: float, meanwhile: Callable[[], object]) -> bool:
        """Wait until every writer has closed the pipe, calling `meanwhile` (the supervisor ships and renews its
        lease) every `every_s`; False after `give_up_s`: a process out of our reach holds it open."""
        deadline = time.monotonic() + give_up_s
        while self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            self._thread.join(min(every_s, max(0.0, deadline - time.monotonic())))
            meanwhile()
        return True

    def take(self) -> bytes:
        """What was read since the last take, after a line saying how many bytes were dropped, if any were."""
        with self._lock:
            chunks, dropped = self._chunks, self._dropped
            self._chunks, self._size, self._dropped = deque(), 0, 0
        return (dropped_marker(dropped) if dropped else b"") + b"".join(chunks)


class LogShipper:
    """Appends output to the job's log, up to a cap per job, keeping the head and the tail of what is over it.

    write() adds to the open transaction; committed() moves on only once it is stored,
    so a failed commit loses nothing: the next write() sends the same text again.

    Of the room the cap leaves this attempt, the first half (the head) is shipped as it comes. Past it the
    shipper keeps only the newest bytes, up to the other half (the tail), in memory: stored chunks cannot be
    un-written, so the tail is stored once the run has ended (a final=True stage), after a line saying how many
    bytes were cut between the two. NOTE: so a log over half its room shows nothing new live past the head until
    the end; then its last part, with the traceback a failed run printed last.
    """

    def __init__(self, db: Session, *, job_id: str, attempt: int, max_bytes: int, node_rank: int = 0):
        self.job_id, self.attempt, self.max_bytes, self.node_rank = job_id, attempt, max_bytes, node_rank
        self.offset, self.seq = logs.log_size(db, job_id=job_id, node_rank=node_rank)
        # Keeps a UTF-8 sequence split across two reads until its last byte arrives.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""
        self._written = 0
        room = max(0, max_bytes - self.offset)
        self._head_left, self._tail_left = room // 2, room - room // 2
        self.truncated = False  # past the head: output goes to the tail
        self._tail, self._cut = bytearray(), 0  # the newest output past the head (UTF-8), and the bytes cut
        self._ending = False  # a final=True stage came: write() stores the tail
        self._tail_sent = False  # the write() in the open transaction holds the tail
        self._at_line_start = True
        self.recent = ""  # the last few KiB, for error excerpts
        self.redact = Redactor(os.environ)  # the worker's secrets, should a rank print them
        self.nul_bytes = 0  # NUL bytes of output stored as U+FFFD

    def stage(self, data: bytes, *, final: bool = False) -> None:
        text = self._decoder.decode(data, final=final)
        if NUL in text:  # NOTE: one NUL would fail every commit of the job's log on PostgreSQL
            self.nul_bytes += text.count(NUL)
            text = text.replace(NUL, REPLACEMENT)
        self.recent = self.redact((self.recent + text)[-8192:])
        self._ending = self._ending or final
        if self.truncated:
            self._keep_tail(text.encode())
            return
        self.pending += text
        if len(self.pending) > self._head_left:  # past the head (a character is a byte or more): bound it now
            self._split_head()

    def _split_head(self) -> None:
        """Keep in `pending` what fits the head; the rest goes to the tail."""
        # Over the whole batch, so a secret split across two reads is whole here.
        self.pending = self.redact(self.pending)
        data = self.pending.encode()
        if len(data) <= self._head_left:
            return
        self.pending = data[: self._head_left].decode(errors="ignore")
        self.truncated = True
        self._keep_tail(data[len(self.pending.encode()):])

    def _keep_tail(self, data: bytes) -> None:
        """Add to the tail, dropping its oldest bytes past the tail's room (counted as cut)."""
        if len(data) >= self._tail_left:
            self._cut += len(self._tail) + len(data) - self._tail_left
            self._tail = bytearray(data[len(data) - self._tail_left:])
            return
        self._tail += data
        if (excess := len(self._tail) - self._tail_left) > 0:
            del self._tail[:excess]
            self._cut += excess

    def _tail_text(self) -> str:
        """The marker line (when bytes were cut) and the tail, starting on a whole line where one starts soon."""
        data, cut = bytes(self._tail), self._cut
        if cut and 0 <= (i := data.find(b"\n", 0, 4096)) < len(data) - 1:
            data, cut = data[i + 1:], cut + i + 1
        text = data.decode(errors="ignore")  # a character the cut split in two
        cut += len(data) - len(text.encode())
        if not cut:
            return self.redact(text)
        marker = (f"[trainjobs] ... {cut} bytes of output cut here "
                  f"(log cap TRAINJOBS_LOG_MAX_BYTES={self.max_bytes}) ...\n")
        head_open = not (self.pending.endswith("\n") if self.pending else self._at_line_start)
        return ("\n" if head_open else "") + marker + self.redact(text)

    def write(self, db: Session) -> None:
        self._split_head()
        text = self.pending
        if self.truncated and self._ending and (self._tail or self._cut):
            self._tail_sent = True
            text += self._tail_text()
        if not text:
            return
        self._written = logs.append(db, job_id=self.job_id, attempt=self.attempt, start=self.offset,
                                    seq=self.seq, text=text, node_rank=self.node_rank)

    def committed(self) -> None:
        if not self._written:
            return
        self._head_left -= len(self.pending.encode())
        if self._tail_sent:  # stored: what comes after (a note of the worker's) has the tail's room left
            self._tail_left = max(0, self._tail_left - len(self._tail))
            self._tail, self._cut, self._tail_sent = bytearray(), 0, False
        self._at_line_start = self.pending.endswith("\n") if self.pending else self._at_line_start
        self.offset, self.seq, self._written, self.pending = self.offset + self._written, self.seq + 1, 0, ""


class MetricTail:
    """Reads complete JSON lines that the reporter appended since the last committed read."""

    def __init__(self, path: Path):
        self.path, self.pos, self._next_pos = path, 0, 0
        self.summary: dict | None = None
        self.last_step, self.last_step_time_s = 0, None
        self.total_steps: int | None = None  # from an entrypoint's report(total_steps=...)
        self.resumed_from_step: int | None = None  # the runtime says so when it loaded a checkpoint
        self.preempted_at_step: int | None = None  # the runtime stopped there on request (checkpoint saved)
        self._last_time: float | None = None
        self._timed = False  # the built-in runtime reports step_time_s; a user's script usually does not
        # What could not be stored as written (committed counts; a failed commit's batch is read again).
        self.renamed, self.dropped = 0, 0  # metric names with NUL (U+FFFD now); non-finite values not stored
        self.first_dropped: tuple[str, int, float] | None = None  # (name, step, value) of the first dropped
        self._changes = (0, 0, None)
        # Each log window's own step time per rank (the runtime's step_time_s/rank<r>), once committed.
        self.rank_windows: list[dict[int, float]] = []
        self._rank_staged: list[dict[int, float]] = []

    def write(self, db: Session, *, job_id: str, attempt: int, node_rank: int = 0) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1
        self._next_pos = self.pos + end
        rows, self._rank_staged = [], []
        renamed, dropped, first = 0, 0, self.first_dropped
        for line in data[:end].splitlines():
            record = parse_record(line)
            if record is None:
                continue
            if record["type"] == "summary":
                self.summary = storable_json(record["summary"])
                continue
            if record["type"] == "progress":
                self.total_steps = record["total_steps"]
                continue
            if record["type"] == "resumed":
                self.resumed_from_step = record["step"]
                continue
            if record["type"] == "preempted":
                self.preempted_at_step = record["step"]
                continue
            t = datetime.fromtimestamp(record["time"], UTC)
            step = record["step"]
            points = {}
            for name, value in record["metrics"].items():
                # Sanitized here, at the edge: one unstorable value would fail the whole batch on every poll.
                stored = storable_text(name)
                renamed += stored != name
                try:
                    value = float(value)
                except OverflowError:  # an integer past any float
                    value = math.inf
                if not math.isfinite(value):
                    dropped += 1
                    first = first or (stored, step, value)
                    continue
                points[stored] = value
            rows.extend((step, name, value, t) for name, value in points.items())
            if ranks := {int(n[len(RANK_SERIES):]): v for n, v in points.items()
                         if n.startswith(RANK_SERIES) and n[len(RANK_SERIES):].isdigit()}:
                self._rank_staged.append(ranks)
            if "step_time_s" in points:
                self.last_step_time_s, self._timed = points["step_time_s"], True
            elif not self._timed and step > self.last_step and self._last_time is not None:
                self.last_step_time_s = (record["time"] - self._last_time) / (step - self.last_step)
            self.last_step, self._last_time = step, record["time"]
        self._changes = (renamed, dropped, first)
        return metrics.insert_batch(db, job_id=job_id, attempt=attempt, node_rank=node_rank, rows=rows)

    def committed(self) -> None:
        self.pos = self._next_pos
        self.rank_windows.extend(self._rank_staged)
        self._rank_staged = []
        renamed, dropped, self.first_dropped = self._changes
        self.renamed, self.dropped, self._changes = self.renamed + renamed, self.dropped + dropped, (0, 0, None)


def sanitized_note(logs: LogShipper, tail: MetricTail) -> str | None:
    """The one log line that says what shipping changed to store an attempt's output and metrics, if anything."""
    changes = []
    if logs.nul_bytes:
        changes.append(f"{logs.nul_bytes} NUL byte(s) of output stored as U+FFFD")
    if tail.renamed:
        changes.append(f"{tail.renamed} metric value(s) whose name held NUL stored under U+FFFD")
    if tail.dropped:
        name, step, value = tail.first_dropped
        changes.append(f"{tail.dropped} non-finite metric value(s) not stored (the first: {name} = {value} "
                       f"at step {step})")
    return f"\n[trainjobs] {'; '.join(changes)}\n" if changes else None
