"""Which rank wrote a line of a job's log: every rank of a multi-rank job starts its lines with `[rank<R>]: `,
and a reader keeps one rank's lines (the prefix removed) with the lines no rank marked.

A node's log is one stream: torchrun's children inherit its stdout and stderr, one pipe that the worker ships.
So the rank is written into the text, where the lines are made. The writer (install, in every rank before the
job's code runs: worker/user_main.py, worker/train/__main__.py) and the reader (rank_lines, in the API's
GET /v1/jobs/{id}/logs?rank=R) share this module, so the format lives in one place. torch's own C++ warnings
start with `[rank<R>]:` (no space) on recent versions: the reader takes those as that rank's too.

The prefix goes in at the Python level (sys.stdout and sys.stderr wrapped), not on the file descriptors: no pipe
and no thread, so nothing is held by a helper that dies with the rank, and C-level output (a segfault report,
NCCL's messages) still goes straight to the fd, unmarked: every rank's view shows it.

NOTE: each stream is line buffered, as Python's are on a terminal: a line goes to the fd in one write once it
ends ('\\n', or '\\r' for a progress bar's redraw), on flush(), or past MAX_PENDING characters. print() writes
its text and its end in two calls; written through at once (PYTHONUNBUFFERED), two ranks printing at the same
moment gave `[rank0]: a[rank1]: b\\n\\n`. One write per line (under PIPE_BUF, 4 KiB) cannot be split by another
rank's; the cost, ~3 us a print over an unwrapped stream (measured here). What a rank killed hard (SIGKILL, a
segfault) loses: the end of a line it neither ended nor flushed. A line a rank flushed unended (its last, at exit)
still runs into the next rank's: the reader cuts a line at our prefix inside it too (a script's own text that
prints `[rank<R>]: ` mid-line is taken for that rank's).

Standard library only: worker/user_main.py imports it before a user's code runs (trainjobs/capture does the same).
"""

import os
import re
import sys
import threading
from typing import TextIO

MAX_PENDING = 4096  # characters of an unended line held before they are written anyway (PIPE_BUF bytes)
_PIECE = re.compile(r"[^\r\n]*[\r\n]|[^\r\n]+")  # each piece ends a line ('\r' or '\n'), or is what is left
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|[\r\n])|[^\r\n]+")  # the reader's lines: '\r\n' is one end
_MARK = re.compile(rb"\[rank(\d+)\]: ?")  # at a line's start; torch's C++ warnings have no space after it
_MARK_INSIDE = re.compile(rb"\[rank(\d+)\]: ")  # ours, inside a line: another rank's line after an unended one


def prefix(rank: int) -> str:
    return f"[rank{rank}]: "


class RankLines:
    """A text stream that writes `prefix` at the start of every line (after a '\\r' too, so a progress bar's
    redraw keeps it) into the stream it wraps, a line at a time; everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO, text: str):
        self._stream, self._prefix = stream, text
        self._pending = ""  # the start of a line not ended yet, its prefix in
        self._at_start, self._after_cr = True, False
        self._lock = threading.RLock()  # threads print too; re-entrant: a signal handler may print mid-write

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not text:
            return 0
        with self._lock:
            if "\n" not in text and "\r" not in text:  # the common case, print()'s text before its end: held
                self._pending += self._prefix + text if self._at_start else text
                self._at_start = self._after_cr = False
                if len(self._pending) > MAX_PENDING:
                    self._stream.write(self._pending)
                    self._pending = ""
                return len(text)
            parts = [self._pending]
            for piece in _PIECE.findall(text):
                # No prefix for the '\n' of a '\r\n' (one end), nor for a bare '\r' (a redraw's first character)
                if self._at_start and piece != "\r" and not (self._after_cr and piece == "\n"):
                    parts.append(self._prefix)
                parts.append(piece)
                self._at_start = piece[-1] in "\r\n"
                self._after_cr = piece[-1] == "\r"
            out = "".join(parts)
            end = max(out.rfind("\n"), out.rfind("\r")) + 1
            if len(out) - end > MAX_PENDING:
                end = len(out)
            self._pending = out[end:]
            if end:
                self._stream.write(out[:end])
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._stream.write(self._pending)
                self._pending = ""
            self._stream.flush()

    def close(self) -> None:
        self.flush()
        self._stream.close()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)  # fileno, isatty, encoding, errors, buffer, reconfigure, ...


def install() -> None:
    """Prefix this rank's sys.stdout and sys.stderr with its global rank, in a job of more than one rank."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    except (KeyError, ValueError):
        return  # not under torchrun
    if world > 1 and not isinstance(sys.stdout, RankLines):
        sys.stdout = RankLines(sys.stdout, prefix(rank))
        sys.stderr = RankLines(sys.stderr, prefix(rank))


def rank_lines(data: bytes, rank: int, *, final: bool) -> tuple[bytes, int]:
    """Rank `rank`'s lines of `data` without their prefix, and the lines no rank marked (torchrun's, C-level
    output), in order; and how many bytes of `data` that read. Only whole lines unless `final` (no more will come):
    the start of a line tells whose it is, so its end waits for the next read rather than be read unmarked."""
    kept: list[bytes] = []
    used = 0
    for match in _LINE.finditer(data):
        line = match.group()
        if not final and line[-1:] not in (b"\n", b"\r"):
            break
        used = match.end()
        kept.extend(_pieces_of(line, rank))
    return b"".join(kept), used


def _pieces_of(line: bytes, rank: int) -> list[bytes]:
    """What of one line is `rank`'s or no rank's. A line a rank left unended (its last one, flushed at exit) runs
    into the next rank's: `[rank0]: bye[rank1]: hi\n`; each part goes to its rank, the cut one given a line end."""
    mark = _MARK.match(line)
    owner, start, pieces = (int(mark.group(1)) if mark else None), (mark.end() if mark else 0), []
    for inner in _MARK_INSIDE.finditer(line, start):
        if inner.start() > start and owner in (None, rank):
            pieces.append(line[start:inner.start()] + b"\n")
        owner, start = int(inner.group(1)), inner.end()
    if owner in (None, rank):
        pieces.append(line[start:])
    return pieces

