"""The root cause of a failed run, from the ranks' torchrun error files (@record), else the exit code."""

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

from service import jobfiles
from trainjobs.rank_output import rank_lines
from trainjobs.states import ErrorType

ERROR_FILE, ERROR_FILE_MAX = "error.json", 1 << 20  # torchrun's per-rank error file (@record), read up to 1 MiB
# Errors a rank reports when a *peer* died: never the root cause when another rank has one.
PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
               "SignalException", "Broken pipe")


def is_peer_error(error: dict | None) -> bool:
    """An error that says another rank (or node) went first: the root cause is elsewhere."""
    text = f"{(error or {}).get('type')}: {(error or {}).get('message')}"
    return any(p in text for p in PEER_ERRORS)


def root_cause(run_dir: Path, exit_code: int | None, *, excerpt: str, entrypoint: bool, node_rank: int = 0,
               nproc: int | None = None) -> dict:
    """The job's `error`. nproc is given for a node of a gang: its ranks' global numbers are c10d's, unknown here."""
    candidates = []
    for rel in jobfiles.find(run_dir, "torchelastic", ERROR_FILE):
        try:  # NOTE: the ranks wrote it: no link followed, no FIFO opened, no more read than an error holds
            data, _ = jobfiles.read_bytes(run_dir, rel, limit=ERROR_FILE_MAX)
            body = json.loads(data)["message"]
            local_rank = int(rel.parent.name)
        except (OSError, ValueError, KeyError, TypeError):  # Refused too: a planted link is no rank's error
            continue
        message = body["message"] if isinstance(body, dict) else str(body)
        extra = body.get("extraInfo", {}) if isinstance(body, dict) else {}
        is_peer = any(p in message for p in PEER_ERRORS)
        candidates.append((is_peer, int(extra.get("timestamp", 0) or 0), local_rank, message,
                           extra.get("py_callstack", "")))
    where = {} if nproc is None else {"node_rank": node_rank}
    if not candidates:
        message = (f"torchrun exited with code {exit_code} and no rank reported an exception"
                   if exit_code else "training ended without a summary")
        if entrypoint:  # no @record in a user's script: its traceback is in the logs
            message = f"the entrypoint exited with code {exit_code}; its output is in the job's logs"
        return {"type": ErrorType.PROCESS_EXIT, "message": message, "rank": None, "exit_code": exit_code,
                "excerpt": excerpt, **where}
    _, raised_at, local_rank, message, stack = min(candidates)
    kind, _, text = message.partition(": ")
    rank = local_rank if nproc is None else None  # single node: the global rank is the local one
    if nproc is not None:
        where["local_rank"] = local_rank
    return {"type": kind or "Error", "message": text or message, "rank": rank, "exit_code": exit_code,
            "traceback": stack[-4000:], "excerpt": rank_excerpt(excerpt, rank), "raised_at": _iso(raised_at), **where}


def rank_excerpt(excerpt: str, rank: int | None) -> str:
    """The failing rank's lines of the output's tail, unprefixed, with those no rank marked (torchrun's): the
    other ranks' chatter left out. Unchanged where the rank is unknown (a gang's node) or nothing is its."""
    if rank is None:
        return excerpt
    kept, _ = rank_lines(excerpt.encode(), rank, final=True)
    return kept.decode(errors="replace") or excerpt


def _iso(epoch_s: int) -> str | None:
    """torchrun's error file stamps the raise in whole epoch seconds; the API gives every time as ISO 8601."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat() if epoch_s else None


# What a write that ran out of space says: the OS's ENOSPC (or a quota), SQLite's, and torch's serialiser, whose
# failed write says only "unexpected pos" or "file write failed" (those count only with the disk indeed short).
NO_SPACE = ("No space left on device", "[Errno 28]", "ENOSPC", "Disk quota exceeded", "database or disk is full")
SHORT_WRITE = ("unexpected pos", "file write failed")


def disk_full(error: dict, *, dirs: list[Path], min_free: int, was_short: bool = False) -> dict | None:
    """The job's error restated as disk_full, naming the fullest of `dirs` and its free space, when the failure was
    a write that ran out of space; None otherwise. The rank's own error is kept under `cause`. was_short: the disk
    was below min_free when the ranks ended (before their half-written checkpoint was removed)."""
    text = " ".join(str(error.get(k) or "") for k in ("type", "message", "traceback", "excerpt"))
    usage = []
    for folder in dirs:
        try:
            usage.append((shutil.disk_usage(folder), folder))
        except OSError:
            continue
    if not usage:
        return None
    (total, _, free), folder = min(usage, key=lambda u: u[0].free)
    short = was_short or free < min_free
    if not (any(m in text for m in NO_SPACE) or (any(m in text for m in SHORT_WRITE) and short)):
        return None
    cause = {k: error.get(k) for k in ("type", "message", "rank") if error.get(k) is not None}
    message = (f"no space left on the disk of {folder}: {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB "
               f"(the job's {cause.get('type', 'error')}: {str(cause.get('message', ''))[:300]})")
    return {**error, "type": ErrorType.DISK_FULL, "message": message, "path": str(folder), "free_bytes": free,
            "cause": cause}
