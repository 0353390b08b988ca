"""A job's artifacts as the API serves them from the object store (TRAINJOBS_STORAGE_URL; service/storage/)."""

from collections.abc import Iterator

from service.errors import ArtifactNotFound
from service.storage import ObjectInfo, Store, artifact_key


def list_artifacts(store: Store, job_id: str) -> list[dict]:
    """Every object under the job's artifacts prefix, named by its path below it."""
    folder = artifact_key(job_id)
    return [{"name": o.key[len(folder):], "size": o.size, "modified": o.modified} for o in store.list(folder)]


def open_artifact(store: Store, job_id: str, name: str) -> tuple[Iterator[bytes], ObjectInfo]:
    """The artifact's bytes, streamed from the store, and its size and time; a name that would leave the job's
    prefix is refused (artifact_key) before the store is asked."""
    key = artifact_key(job_id, name)
    info = store.head(key)
    if info is None:
        raise ArtifactNotFound(f"job {job_id} has no artifact {name!r}", field="name")
    # NOTE: the length served is the one read here; an artifact replaced meanwhile (a retry) ends the stream early.
    return store.read(key, 0, info.size - 1) if info.size else iter(()), info
