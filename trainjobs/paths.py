"""Job ids and where a job's files live: pure, so the API, the worker and the ranks agree.

A job's folder is TRAINJOBS_STORAGE_DIR/jobs/<id>/ with checkpoints/ and artifacts/ in it. Every worker of a
job must see the same folder (a shared filesystem in production), so a retry on another machine resumes
from the checkpoints the first one wrote.
"""

import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from trainjobs.errors import InvalidRequest, NotFound

JOB_ID_LEN = 20
CHECKPOINTS = "checkpoints"
ARTIFACTS = "artifacts"


def new_job_id() -> str:
    """A time-ordered id: 12 hex digits of milliseconds, then 8 random ones."""
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


def is_job_id(value: str) -> bool:
    return len(value) == JOB_ID_LEN and all(c in "0123456789abcdef" for c in value)


def job_dir(storage_dir: Path, job_id: str) -> Path:
    """The job's folder; the id is checked first so no path can be smuggled in through it."""
    if not is_job_id(job_id):
        raise NotFound(f"job {job_id!r} not found", field="job_id")
    return storage_dir / "jobs" / job_id


MODEL_FILE = "model.pt"  # in artifacts/: the built-in runtime's final weights (plain parameter names)
CHECKPOINT_PREFIX, CHECKPOINT_COMPLETE = "step_", "COMPLETE"  # worker/train/checkpoint.py's layout
# What marks a user's script's checkpoint `step_N` whole: COMPLETE (trainjobs.complete_checkpoint), or the
# `.metadata` that torch.distributed.checkpoint's coordinator writes last, once every rank's files are written.
SCRIPT_MARKS = (CHECKPOINT_COMPLETE, ".metadata")


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (`step_00000500`: 500), or None for any other name."""
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() and digits.isascii() else None


def complete_checkpoints(root: Path, marks: tuple[str, ...] = (CHECKPOINT_COMPLETE,)) -> list[Path]:
    """The checkpoint folders in `root` holding one of `marks` (written last, once the rest is), oldest first.

    NOTE: a job writes its checkpoints folder: a `step_N` or a mark that is a link (to another job's checkpoint)
    is none of its checkpoints."""
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if checkpoint_step(p.name) is not None
             and _is_real(p, stat.S_ISDIR) and any(_is_real(p / mark, stat.S_ISREG) for mark in marks)] \
        if root.is_dir() else []
    return sorted(found, key=lambda p: checkpoint_step(p.name))


def _is_real(path: Path, kind: Callable[[int], bool]) -> bool:
    """`path` is of `kind` itself: not a link to one."""
    try:
        return kind(path.lstat().st_mode)
    except OSError:
        return False


def latest_checkpoint(job_folder: Path) -> Path | None:
    """The newest complete checkpoint in a job's folder (torch-free: the API checks it too)."""
    found = complete_checkpoints(job_folder / CHECKPOINTS)
    return found[-1] if found else None


def partial_checkpoints(job_folder: Path) -> list[Path]:
    """The checkpoint folders in a job's folder that never completed (no COMPLETE): never loaded, only space taken."""
    root = job_folder / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*")
                  if p.is_dir() and not (p / CHECKPOINT_COMPLETE).exists())


def init_source(storage_dir: Path, job_id: str, checkpoint: str) -> Path | None:
    """What `init_from: {job, checkpoint}` loads: the job's final model.pt, or its latest complete checkpoint."""
    folder = job_dir(storage_dir, job_id)
    if checkpoint == "final":
        path = folder / ARTIFACTS / MODEL_FILE
        # Whatever lies there: the worker opens it as service/jobfiles.py does, and names a link or a FIFO it finds.
        return path if os.path.lexists(path) else None
    return latest_checkpoint(folder)


# The service's own entries of the data dir: never shown to a job (worker/sandbox.py), never a data.path.
SERVICE_OWNED = ("runs", "storage", "envs", "package-cache", "image-cache", "redis", "packages", "trainjobs.db",
                 "trainjobs.db-wal", "trainjobs.db-shm", "trainjobs.db-journal")


def resolve_data_path(path: str, data_dir: Path, *, hidden: Iterable[Path] = ()) -> Path:
    """A dataset file under data_dir; a path that escapes it is refused.

    One of the service's own (SERVICE_OWNED, or in `hidden`: Settings.service_paths) is refused with the words
    a missing file gets, so that data.path tells no one which jobs, runs or files the service holds."""
    root, hidden = data_dir.resolve(), tuple(hidden)
    # NOTE: the words first (before any link is followed): `runs/<x>/link/..` must not tell a link from a file.
    lexical = Path(os.path.normpath(root / path))
    full = (root / path).resolve()
    if _service_owned(lexical, root, hidden) or _service_owned(full, root, hidden):
        raise InvalidRequest(missing_data_path(path), field="data.path")
    if not full.is_relative_to(root):
        raise InvalidRequest(f"data.path {path!r} is outside the data directory", field="data.path")
    return full


def _service_owned(path: Path, root: Path, hidden: tuple[Path, ...]) -> bool:
    if any(path.is_relative_to(h) for h in hidden):
        return True
    if not path.is_relative_to(root) or path == root:
        return False
    top = path.relative_to(root).parts[0]
    return top in SERVICE_OWNED or top.startswith("trainjobs.db")


def missing_data_path(path: str) -> str:
    return f"data.path {path!r} is not a file under the data directory"
