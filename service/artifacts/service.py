"""A job's files as the API serves them: its artifacts folder (trainjobs/paths.py says where it is)."""

from pathlib import Path

from service.errors import InvalidRequest
from service.settings import Settings
from trainjobs.paths import ARTIFACTS, CHECKPOINTS, job_dir


def checkpoint_dir(settings: Settings, job_id: str) -> Path:
    return job_dir(settings.resolved_storage_dir, job_id) / CHECKPOINTS


def artifacts_dir(settings: Settings, job_id: str) -> Path:
    return job_dir(settings.resolved_storage_dir, job_id) / ARTIFACTS


def artifact_path(settings: Settings, job_id: str, name: str) -> Path:
    """An artifact by its name relative to the job's artifacts folder; never a path outside it."""
    root = artifacts_dir(settings, job_id).resolve()
    if not name or "\0" in name or name.startswith("/") or ".." in name.replace("\\", "/").split("/"):
        raise InvalidRequest(f"artifact name {name!r} is not a file name inside the job's artifacts", field="name")
    path = (root / name).resolve()
    if not path.is_relative_to(root):  # a symlink pointing out
        raise InvalidRequest(f"artifact name {name!r} points outside the job's artifacts", field="name")
    return path


def list_artifacts(settings: Settings, job_id: str) -> list[dict]:
    root = artifacts_dir(settings, job_id).resolve()
    if not root.is_dir():
        return []
    files = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.resolve().is_relative_to(root):
            stat = path.stat()
            files.append({"name": path.relative_to(root).as_posix(), "size": stat.st_size,
                          "modified": stat.st_mtime})
    return files
