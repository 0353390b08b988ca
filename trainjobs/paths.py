"""Job ids and where a job's files live: pure, so the API, the worker and the ranks agree.

A job's folder is TRAINJOBS_STORAGE_DIR/jobs/<id>/ with checkpoints/ and artifacts/ in it. Every worker of a
job must see the same folder (a shared filesystem in production), so a retry on another machine resumes
from the checkpoints the first one wrote.
"""

import secrets
import time
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


def resolve_data_path(path: str, data_dir: Path) -> Path:
    """A dataset file under data_dir; a path that escapes it is refused."""
    root = data_dir.resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        raise InvalidRequest(f"data.path {path!r} is outside the data directory", field="data.path")
    return full
