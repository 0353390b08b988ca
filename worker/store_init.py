"""init_from with a store (issue 31): another job's weights, from the store into this machine's cache, where the
sandbox lends them read-only as a local source's (worker/sandbox.py). A checkpoint counts only once its manifest
is stored, as for a resume (worker/store_sync.py, whose download and retries this reuses)."""

import fcntl
import os
from pathlib import Path

from service import jobfiles
from service.settings import Settings
from service.storage import StoreUnavailable, artifact_key, open_store
from service.storage.store import Store
from trainjobs import paths
from worker.lease import Lease
from worker.store_sync import BACKOFF_MAX_S, AttemptSync


def fetch_init_source(settings: Settings, job_id: str, checkpoint: str, *, lease: Lease | None = None) -> Path | None:
    """What `init_from: {job, checkpoint}` loads (paths.init_source), fetched first where a store is set: into the
    source's folder in this machine's storage dir (its cache), where the sandbox lends it as a local one. "final":
    its model.pt, where the cache lacks it; "latest": the store's newest complete checkpoint, where the cache has
    none as new, each file checked against its manifest as a resume's. StoreUnavailable past store_wait_s."""
    store, storage = open_store(settings), settings.resolved_storage_dir
    if store is not None and not (checkpoint == "final" and paths.init_source(storage, job_id, checkpoint)):
        folder = paths.job_dir(storage, job_id)
        sync = AttemptSync(store, job_id=job_id, job_dir=folder, keep=1, wait_s=settings.store_wait_s,
                           alive=None if lease is None else
                           lambda: lease.tick(busy_s=6 * settings.store_timeout_s + BACKOFF_MAX_S))
        folder.mkdir(parents=True, exist_ok=True)
        # NOTE: one fetch of a source at a time on this machine (a sweep's trials start from one job together):
        # the others wait, then find it in the cache.
        with open(folder / ".fetch.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sync._retrying(sync._restore if checkpoint == "latest" else lambda: _fetch_model(store, job_id, folder),
                           what=f"fetching the {checkpoint} weights of job {job_id} (init_from)")
    return paths.init_source(storage, job_id, checkpoint)


def _fetch_model(store: Store, job_id: str, folder: Path) -> None:
    """The job's final model.pt into its artifacts folder: beside, checked against the store's size, renamed."""
    dest, key = folder / paths.ARTIFACTS / paths.MODEL_FILE, artifact_key(job_id, paths.MODEL_FILE)
    if jobfiles.is_real(folder, f"{paths.ARTIFACTS}/{paths.MODEL_FILE}") or (info := store.head(key)) is None:
        return
    dest.parent.mkdir(exist_ok=True)
    # NOTE: staged in the service's folder, not the job's artifacts, where a planted link would take the write.
    temp = jobfiles.staging(folder.parent.parent) / f"fetch-{job_id}-{paths.MODEL_FILE}-{os.getpid()}"
    try:
        store.get_file(key, temp)
        if temp.stat().st_size != info.size:
            raise StoreUnavailable(f"the store {store.url} gave {key} with {temp.stat().st_size} bytes, "
                                   f"its listing says {info.size}")
        owner = dest.parent.lstat()
        if owner.st_uid != os.geteuid():  # the job's uid's folder (sandbox.hand_over)
            os.lchown(temp, owner.st_uid, owner.st_gid)
        jobfiles.place(temp, dest.parent, dest.name)
    except FileNotFoundError:  # deleted since the listing (retention): the job has none
        return
    finally:
        temp.unlink(missing_ok=True)
