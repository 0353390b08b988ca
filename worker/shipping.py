"""What a run writes (output, metric lines), read in bounded batches for the worker protocol's `ship`."""

import codecs
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

from service import jobfiles
from service.runners.points import POINTS_MAX
from trainjobs.runenv import METRIC_NAME_MAX, parse_record
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


PUMP_MAX_PENDING = 2 * 2**20  # bytes an OutputPump holds untaken; past it the oldest go, so the tail survives
TAIL_MAX = 2**20  # bytes of a log's tail held in memory until the run ends (the rest of its room is the head's)
PART_CHARS = 2**20  # characters of output one batch carries (ship_calls.LOG_TEXT_MAX bounds head + tail)
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

    part() gives the next chunk as data for a batch (at most PART_CHARS of output, then the tail); committed() moves
    on only once it is stored, so a batch that was not loses nothing: the next part() holds its text again. Output
    staged while a batch is on its way stays for the next one.

    Of the room the cap leaves this attempt, the head (half, or all but TAIL_MAX) is shipped as it comes. Past it the
    shipper keeps only the newest bytes, up to the rest (the tail), in memory: stored chunks cannot be
    un-written, so the tail is stored once the run has ended (a final=True stage), after a line saying how many
    bytes were cut between the two. NOTE: so a log over half its room shows nothing new live past the head until
    the end; then its last part, with the traceback a failed run printed last.
    """

    def __init__(self, *, job_id: str, attempt: int, max_bytes: int, node_rank: int = 0, offset: int = 0,
                 seq: int = 1):
        """`offset`, `seq`: the node's log as stored (bytes, next chunk's seq), from the protocol's `open`."""
        self.job_id, self.attempt, self.max_bytes, self.node_rank = job_id, attempt, max_bytes, node_rank
        self.offset, self.seq = offset, seq
        # Keeps a UTF-8 sequence split across two reads until its last byte arrives.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""
        self._written = 0
        room = max(0, max_bytes - self.offset)
        self._tail_left = min(room - room // 2, TAIL_MAX)
        self._head_left = room - self._tail_left
        self.truncated = False  # past the head: output goes to the tail
        self._tail, self._cut = bytearray(), 0  # the newest output past the head (UTF-8), and the bytes cut
        self._ending = False  # a final=True stage came: part() holds the tail
        self._sent_chars = 0  # characters of `pending` the last part() holds
        self._tail_sent: int | None = None  # bytes of the tail the last part() holds
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

    @property
    def news(self) -> bool:
        """Whether part() has anything to store (staged output, or the tail once the run has ended)."""
        self._split_head()
        return bool(self.pending) or (self.truncated and self._ending and bool(self._tail or self._cut))

    def part(self) -> dict | None:
        """The next chunk as a batch carries it ({start, seq, text}), None for none: at most PART_CHARS of the
        staged output and, once all of it is in and the run has ended, the tail. Until committed() it stays
        staged (a part() again holds it again)."""
        self._split_head()
        text = self.pending[:PART_CHARS]
        self._sent_chars, self._tail_sent = len(text), None
        if len(text) == len(self.pending) and self.truncated and self._ending and (self._tail or self._cut):
            self._tail_sent = len(self._tail)
            text += self._tail_text()
        self._written = len(text.encode())
        return {"start": self.offset, "seq": self.seq, "text": text} if text else None

    def committed(self) -> None:
        """The last part() is stored: move past it (what was staged since stays for the next)."""
        if not self._written:
            return
        sent = self.pending[:self._sent_chars]
        self._head_left -= len(sent.encode())
        if self._tail_sent is not None:  # stored: what comes after (a note of the worker's) has the tail's room left
            self._tail_left = max(0, self._tail_left - self._tail_sent)
            del self._tail[:self._tail_sent]
            self._cut, self._tail_sent = 0, None
        self._at_line_start = sent.endswith("\n") if sent else self._at_line_start
        self.pending = self.pending[self._sent_chars:]
        self.offset, self.seq, self._written, self._sent_chars = self.offset + self._written, self.seq + 1, 0, 0


@dataclass(frozen=True)
class MetricCaps:
    """What one job (one node of a gang) may store of metrics (the TRAINJOBS_METRIC_* settings)."""

    max_points: int = 2_000_000
    max_names: int = 1_000
    name_max_chars: int = METRIC_NAME_MAX
    rows_per_ship: int = 10_000  # the rate bound: points per second × the supervisor's poll

    @classmethod
    def of(cls, settings) -> "MetricCaps":
        return cls(max_points=settings.metric_max_points, max_names=settings.metric_max_names,
                   name_max_chars=settings.metric_name_max_chars,
                   rows_per_ship=min(POINTS_MAX, max(100, int(settings.metric_max_points_per_s * settings.poll_s))))


READ_MAX = 4 * 2**20  # bytes of the metrics file read per ship
THIN_BACKLOG = 4 * READ_MAX  # unread bytes past which the step records read are thinned


@dataclass
class Counts:
    """What a job's metric lines held that was not stored as written (committed counts)."""

    renamed: int = 0  # values whose name held NUL (stored under U+FFFD)
    dropped: int = 0  # non-finite values
    first_dropped: tuple[str, int, float] | None = None  # (name, step, value) of the first non-finite one
    over_points: int = 0  # points past max_points
    thinned: int = 0  # points left out while the job reported faster than rows_per_ship
    long_names: int = 0  # points under a name longer than name_max_chars
    first_long: str | None = None
    new_names: int = 0  # points under a new name past max_names
    first_new: str | None = None
    long_lines: int = 0  # lines longer than READ_MAX (skipped whole)
    refused: int = 0  # points of a batch the database refused on its own (given up)

    def add(self, other: "Counts") -> None:
        for name, value in vars(other).items():
            if isinstance(value, int):
                setattr(self, name, getattr(self, name) + value)
            elif getattr(self, name) is None:
                setattr(self, name, value)

    @property
    def capped(self) -> int:
        return self.over_points + self.thinned + self.long_names + self.new_names + self.refused


# The series a job's page shows as its live performance (service/jobs/schemas.py Performance), newest values.
LIVE = ("samples_per_s", "tokens_per_s", "step_time_s", "mfu", "gpu_util", "gpu_mem_peak_mb")


class MetricTail:
    """Reads complete JSON lines that the reporter appended since the last committed read, in bounded batches.

    Each batch (stage() reads it, part() gives it to a ship) is at most READ_MAX bytes and caps.rows_per_ship points
    (the rest waits in the file, on the run dir's disk, for the next one: `more`); while more than THIN_BACKLOG bytes
    wait, it keeps one step record in k and counts the others as thinned, so a job that reports faster than the
    service ingests neither grows the worker's memory nor holds its end for long. Per job: at most max_points
    points and max_names names, each name at most name_max_chars; what is past a cap is counted (`counts`), never
    stored and never a failure. known_names and points: what earlier attempts stored (Supervisor reads them).
    """

    def __init__(self, path: Path, caps: MetricCaps | None = None, *, known_names: set[str] | None = None,
                 points: int = 0):
        self.path, self.pos, self._next_pos = path, 0, 0
        self.caps = caps or MetricCaps()
        self.names, self.points = set(known_names or ()), points
        self.summary: dict | None = None
        self.last_step, self.last_step_time_s = 0, None
        self.live: dict[str, float] = {}  # the newest of the LIVE series: the job's performance while it runs
        self.total_steps: int | None = None  # from an entrypoint's report(total_steps=...)
        self.resumed_from_step: int | None = None  # the runtime says so when it loaded a checkpoint
        self.preempted_at_step: int | None = None  # the runtime stopped there on request (checkpoint saved)
        self._last_time: float | None = None
        self._timed = False  # the built-in runtime reports step_time_s; a user's script usually does not
        self.counts = Counts()
        self._staged = (Counts(), set(), 0, 0)  # this write's counts, new names, points, rows
        self._rows: list[tuple[int, str, float, float]] | None = None  # what stage() read, for part()
        self.more = False  # the batch left lines in the file for the next one
        self._skipping = False  # inside a line longer than READ_MAX: its rest is skipped
        self._records = 0  # step records read, for thinning
        # Each log window's own step time per rank (the runtime's step_time_s/rank<r>), once committed.
        self.rank_windows: list[dict[int, float]] = []
        self._rank_staged: list[dict[int, float]] = []
        self.refused: str | None = None  # why the file is no longer read ("metrics.jsonl is a FIFO"): the job fails

    def _read(self) -> tuple[bytes, int]:
        """The next complete lines (at most READ_MAX bytes) and how many bytes wait after them."""
        if self.refused:
            return b"", 0
        try:  # NOTE: the job owns its run dir: the file may be a link or a FIFO it planted (service/jobfiles.py)
            data, size = jobfiles.read_bytes(self.path.parent, self.path.name, limit=READ_MAX, offset=self.pos)
        except FileNotFoundError:
            return b"", 0
        except jobfiles.Refused as exc:
            self.refused = str(exc)
            return b"", 0
        return data, max(0, size - self.pos - len(data))  # (the file may have grown since the fstat)

    def part(self) -> list[tuple[int, str, float, float]]:
        """The points stage() read (reading them now if none are staged), as a batch carries them: (step, name,
        value, unix time) (service/runners/ship_calls.py). committed() moves on once they are stored."""
        if self._rows is None:
            self.stage()
        rows, self._rows = self._rows, None
        return rows

    def stage(self) -> int:
        """Read and parse the next batch from the file: the points part() gives.

        Read again from the last committed position on every call, so a batch whose commit failed is the next
        one again. A ship with nothing staged (and nothing else new) needs no transaction (worker/attempt/ship.py).
        """
        data, waiting = self._read()
        counts, new_names, rows = Counts(), set(), []
        self._rows = rows
        skip = 0
        if self._skipping or (data and b"\n" not in data and len(data) == READ_MAX):  # (the rest of) a huge line
            newline = data.find(b"\n")
            if newline < 0:
                self._next_pos, self.more, self._skipping = self.pos + len(data), waiting > 0, True
                self._staged = (counts, new_names, 0, 0)
                return 0
            skip, self._skipping = newline + 1, False
            counts.long_lines += 1
        end = data.rfind(b"\n") + 1
        self._next_pos, self.more = self.pos + end, waiting > 0  # (a last line without its newline: not yet)
        stride = 1 + waiting // THIN_BACKLOG
        records = self._records
        self._rank_staged = []
        offset = skip
        for line in data[skip:end].splitlines(keepends=True):
            offset += len(line)
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
            if len(rows) + len(record["metrics"]) > self.caps.rows_per_ship and rows:  # the rest: the next batch
                self._next_pos, self.more = self.pos + offset - len(line), True
                break
            records += 1
            step = record["step"]
            if records % stride:  # behind by more than THIN_BACKLOG: one step record in `stride` is kept
                counts.thinned += len(record["metrics"])
            else:
                points = self._points(record, counts, new_names, len(rows))
                # (C-speed: the hot loop)
                rows.extend(zip(repeat(step), points, points.values(), repeat(record["time"])))
                if ranks := {int(n[len(RANK_SERIES):]): v for n, v in points.items()
                             if n.startswith(RANK_SERIES) and n[len(RANK_SERIES):].isdigit()}:
                    self._rank_staged.append(ranks)
                if "step_time_s" in points:
                    self.last_step_time_s, self._timed = points["step_time_s"], True
                for name in LIVE:
                    if name in points:
                        self.live[name] = points[name]
            if not self._timed and step > self.last_step and self._last_time is not None:
                self.last_step_time_s = (record["time"] - self._last_time) / (step - self.last_step)
            self.last_step, self._last_time = step, record["time"]
        self._staged = (counts, new_names, len(rows), records)
        return len(rows)

    def _points(self, record: dict, counts: Counts, new_names: set[str], staged: int) -> dict[str, float]:
        """The record's points that are stored: sanitized, finite, and within the job's caps."""
        caps, step, points, names = self.caps, record["step"], {}, self.names
        room = caps.max_points - self.points - staged  # points this record may still add
        for name, value in record["metrics"].items():
            # A name stored before is storable as it is (and counted): the common case, checked in one lookup.
            known = name in names and len(name) <= caps.name_max_chars
            if known:
                stored = name
            else:  # sanitized here, at the edge: one unstorable value would fail the whole batch on every poll
                stored = storable_text(name)
                counts.renamed += stored != name
            try:
                value = float(value)
            except OverflowError:  # an integer past any float
                value = math.inf
            if not math.isfinite(value):
                counts.dropped += 1
                counts.first_dropped = counts.first_dropped or self.counts.first_dropped or (stored, step, value)
                continue
            if not known:
                if len(stored) > caps.name_max_chars:
                    counts.long_names += 1
                    counts.first_long = counts.first_long or stored[:100]
                    continue
                if stored not in names and stored not in new_names:
                    if len(names) + len(new_names) >= caps.max_names:
                        counts.new_names += 1
                        counts.first_new = counts.first_new or stored
                        continue
                    new_names.add(stored)
            if len(points) >= room:
                counts.over_points += 1
                continue
            points[stored] = value
        return points

    def committed(self) -> None:
        self.pos, self._rows = self._next_pos, None
        self.rank_windows.extend(self._rank_staged)
        self._rank_staged = []
        counts, new_names, rows, records = self._staged
        self.counts.add(counts)
        self.names |= new_names
        self.points += rows
        self._records = max(self._records, records)
        self._staged = (Counts(), set(), 0, 0)

    def give_up(self) -> None:
        """The database refused the last batch on its own: move past it, counting its points as refused."""
        counts, _, rows, records = self._staged
        counts.refused += rows
        self._staged = (counts, set(), 0, records)
        self.committed()

    def note(self) -> str | None:
        """What the caps kept out of the database, in a sentence; None when nothing was."""
        c, caps = self.counts, self.caps
        if not c.capped and not c.long_lines:
            return None
        parts = [f"kept {self.points:,} of {self.points + c.capped:,} metric points"]
        if c.over_points:
            parts.append(f"{c.over_points:,} past the job's cap (TRAINJOBS_METRIC_MAX_POINTS={caps.max_points})")
        if c.thinned:
            parts.append(f"{c.thinned:,} thinned while the job reported faster than the service ships "
                         f"(TRAINJOBS_METRIC_MAX_POINTS_PER_S)")
        if c.new_names:
            parts.append(f"{c.new_names:,} under names past the job's {caps.max_names} "
                         f"(TRAINJOBS_METRIC_MAX_NAMES; the first refused: {c.first_new!r})")
        if c.long_names:
            parts.append(f"{c.long_names:,} under names longer than {caps.name_max_chars} characters "
                         f"(the first: {c.first_long!r})")
        if c.refused:
            parts.append(f"{c.refused:,} in a batch the database refused")
        if c.long_lines:
            parts.append(f"{c.long_lines} line(s) of the metrics file longer than {READ_MAX} bytes skipped")
        return "; ".join(parts)


def sanitized_note(logs: LogShipper, tail: MetricTail) -> str | None:
    """The one log line that says what shipping changed to store an attempt's output and metrics, if anything."""
    changes = []
    if logs.nul_bytes:
        changes.append(f"{logs.nul_bytes} NUL byte(s) of output stored as U+FFFD")
    counts = tail.counts
    if counts.renamed:
        changes.append(f"{counts.renamed} metric value(s) whose name held NUL stored under U+FFFD")
    if counts.dropped:
        name, step, value = counts.first_dropped
        changes.append(f"{counts.dropped} non-finite metric value(s) not stored (the first: {name} = {value} "
                       f"at step {step})")
    if note := tail.note():
        changes.append(note)
    return f"\n[trainjobs] {'; '.join(changes)}\n" if changes else None
