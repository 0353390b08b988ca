"""The root cause of a failed run, from the ranks' torchrun error files (@record), else the exit code."""

import json
from pathlib import Path

from trainjobs.states import ErrorType

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
    for path in (run_dir / "torchelastic").glob("**/error.json"):
        try:
            body = json.loads(path.read_text())["message"]
            local_rank = int(path.parent.name)
        except (OSError, ValueError, KeyError, TypeError):
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
            "traceback": stack[-4000:], "excerpt": excerpt, "raised_at": raised_at or None, **where}
