"""Where checkpoints and artifacts are kept when workers share no filesystem (issue 31).

`open_store(settings)` is None without TRAINJOBS_STORAGE_URL: the storage dir is then the one place, as it always
was. With one, the store (store.py's directory, or s3.py's S3-compatible bucket) holds every job's checkpoints
and artifacts under `<prefix>/jobs/<id>/`, and each machine's storage dir is only its local cache: the worker
uploads and downloads (worker/store_sync.py), the API streams artifacts from it (service/artifacts/).
"""

from urllib.parse import urlparse

from service.settings import Settings
from service.storage.store import (
    DirectoryStore,
    ObjectInfo,
    Store,
    StoreUnavailable,
    artifact_key,
    checkpoint_key,
    job_prefix,
)

__all__ = ["DirectoryStore", "ObjectInfo", "Store", "StoreUnavailable", "artifact_key", "check_store",
           "checkpoint_key", "job_prefix", "open_store"]


def open_store(settings: Settings) -> Store | None:
    """The store TRAINJOBS_STORAGE_URL names (s3://bucket/prefix, file:///folder), or None: the storage dir alone."""
    url = settings.storage_url
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from service.storage.s3 import S3Store  # boto3 only where a store is configured: the CLI starts fast

        return S3Store(bucket=parsed.netloc, prefix=parsed.path.strip("/"), timeout_s=settings.store_timeout_s)
    if parsed.scheme == "file":
        return DirectoryStore(parsed.path)
    raise ValueError(f"TRAINJOBS_STORAGE_URL {url!r}: expected s3://bucket/prefix or file:///folder")


def check_store(settings: Settings, *, who: str) -> Store | None:
    """At a process's start: the configured store answers (bucket there, credentials good), else SystemExit."""
    try:
        store = open_store(settings)
        if store is not None:
            store.check()
    except (StoreUnavailable, ValueError) as exc:
        raise SystemExit(f"trainjobs {who}: {exc}") from None
    return store
