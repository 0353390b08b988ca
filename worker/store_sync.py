"""An attempt's checkpoints and artifacts to and from the object store (issue 31): the worker's, never the ranks'.

The ranks write checkpoints on local disk as without a store (fast, and no credentials in the job's sandbox);
a thread of the supervisor uploads each new complete one while training goes on, then writes its manifest
(`jobs/<id>/checkpoint-manifests/step_N.json`: every file and its size) last. Only a checkpoint with a manifest
counts: an upload cut off half-way leaves the one before the latest. Retention keeps the newest
`train.keep_checkpoints` (a manifest is deleted before its files). Before launch, an attempt whose local folder
lacks the store's newest checkpoint downloads it (beside, then renamed into place). At the end the last
checkpoint and the artifacts are stored, retried up to `store_wait_s`; a job whose artifacts could not be stored
fails naming the store rather than succeeding without them.

NOTE: the ranks write these folders, so a file in them may be a link planted to make the worker (root) upload
something else: every file is opened from its folder's descriptor with O_NOFOLLOW, as service/artifacts does.
"""

import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service.settings import Settings
from service.storage import StoreUnavailable, artifact_key, open_store
from service.storage.store import Store, checkpoint_key, manifest_key
from trainjobs import paths
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType

log = logging.getLogger(__name__)
STORE_UNAVAILABLE = ErrorType.STORE_UNAVAILABLE  # the job's error type when the store kept its artifacts out
SCAN_S = 1.0  # how often the upload thread looks for a new complete checkpoint
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 15.0
STEP = re.compile(rf"{paths.CHECKPOINT_PREFIX}(\d+)")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NoSync:
    """Without a store (or for what this slice does not sync): nothing to do."""

    def restore(self) -> dict | None:
        return None

    def start(self) -> None:
        pass

    def finish(self, *, succeeded: bool) -> dict | None:
        return None

    def close(self) -> None:
        pass


def for_attempt(settings: Settings, *, job_id: str, job_dir: Path, spec: JobSpec, node_rank: int, gang: bool,
                stale: Callable[[], bool] = lambda: False) -> "AttemptSync | NoSync":
    """The attempt's sync, or NoSync without a store. `stale()`: the attempt lost the job (its lease), so it
    stores nothing more: fencing across machines, where the job folder's OWNER file is only local.
    NOTE: a gang's nodes each hold only their own shards, so its checkpoints are not stored yet (left for the
    gang slice of issue 31); node 0 stores its artifacts."""
    store = open_store(settings)
    if store is None or node_rank != 0:
        return NoSync()
    return AttemptSync(store, job_id=job_id, job_dir=job_dir, keep=spec.train.keep_checkpoints,
                       wait_s=settings.store_wait_s, checkpoints=not gang and spec.entrypoint is None, stale=stale)


class AttemptSync:
    def __init__(self, store: Store, *, job_id: str, job_dir: Path, keep: int, wait_s: float,
                 checkpoints: bool = True, stale: Callable[[], bool] = lambda: False):
        self.store, self.job_id, self.job_dir, self.keep, self.wait_s = store, job_id, job_dir, keep, wait_s
        self.stale = stale
        self.checkpoints = checkpoints  # the built-in runtime's step_N/COMPLETE layout, a single node
        self.stored_step = -1  # the newest checkpoint with a manifest in the store, as far as this attempt knows
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- before launch -------------------------------------------------------------------------------------------
    def restore(self) -> dict | None:
        """The store's newest checkpoint into the local folder, where it lacks it; an error dict if the store
        stays out of reach for store_wait_s (the attempt then fails, retryable, rather than start from scratch)."""
        if not self.checkpoints:
            return None
        try:
            self._retrying(self._restore, what="fetching the newest checkpoint")
        except StoreUnavailable as exc:
            return {"type": STORE_UNAVAILABLE, "rank": None, "message": f"{exc.message}: the job's newest "
                    f"checkpoint could not be fetched within store_wait_s={self.wait_s:g}s"}
        return None

    def _restore(self) -> None:
        newest = self.newest_manifest()
        if newest is None:
            return
        self.stored_step = newest["step"]
        local = paths.latest_checkpoint(self.job_dir)
        if local is not None and _step(local.name) >= newest["step"]:
            return
        root = self.job_dir / paths.CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".restore-{newest['name']}"
        shutil.rmtree(staging, ignore_errors=True)
        for rel, size in newest["files"].items():
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.store.get_file(checkpoint_key(self.job_id, newest["name"], rel), dest)
            if dest.stat().st_size != size:
                raise StoreUnavailable(f"the store {self.store.url} gave {rel} of {newest['name']} with "
                                       f"{dest.stat().st_size} bytes, its manifest says {size}")
        final = root / newest["name"]
        shutil.rmtree(final, ignore_errors=True)  # a half-written one of an attempt that died here
        os.replace(staging, final)
        owner = root.stat()
        if owner.st_uid != os.geteuid():  # the job's uid's folder (sandbox.hand_over): it may prune this one too
            for path in (final, *final.rglob("*")):
                os.lchown(path, owner.st_uid, owner.st_gid)
        log.info("job %s: checkpoint %s fetched from %s", self.job_id, newest["name"], self.store.url)

    def newest_manifest(self) -> dict | None:
        """The newest checkpoint the store holds whole (its manifest), or None."""
        manifests = self._manifests()
        return json.loads(self.store.get_bytes(manifests[-1][1])) if manifests else None

    def _manifests(self) -> list[tuple[int, str]]:
        found = []
        for obj in self.store.list(manifest_key(self.job_id)):
            name = obj.key.rsplit("/", 1)[1].removesuffix(".json")
            if STEP.fullmatch(name):
                found.append((_step(name), obj.key))
        return sorted(found)

    # --- while the ranks run -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.checkpoints:
            self._thread = threading.Thread(target=self._loop, name=f"store-sync-{self.job_id}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        wait, failures = SCAN_S, 0
        while not self._stop.wait(wait):
            try:
                self.upload_newest()
                wait, failures = SCAN_S, 0
            except StoreUnavailable as exc:  # the job trains on; its checkpoint waits for the store
                failures += 1
                wait = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
                log.warning("job %s: %s; retrying in %.1fs", self.job_id, exc.message, wait)
            except Exception:  # noqa: BLE001 - an upload bug must never end a healthy run
                log.exception("job %s: storing a checkpoint failed", self.job_id)
                wait = BACKOFF_MAX_S

    def upload_newest(self) -> str | None:
        """The newest complete local checkpoint into the store, if it is newer than the stored one: every file,
        then its manifest, then retention. Returns its name, or None when there was nothing new."""
        local = paths.latest_checkpoint(self.job_dir)
        if local is None or _step(local.name) <= self.stored_step or self.stale():
            return None
        try:
            files = upload_tree(self.store, self.job_dir / paths.CHECKPOINTS, local.name,
                                lambda rel: checkpoint_key(self.job_id, local.name, rel), whole=True)
        except FileNotFoundError:  # pruned by the ranks meanwhile: a newer one is there
            return None
        now = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and not p.is_symlink()}
        if paths.CHECKPOINT_COMPLETE not in files or now != set(files):  # pruned under the upload
            return None
        manifest = {"name": local.name, "step": _step(local.name), "files": files, "stored_at": time.time()}
        if self.stale():
            return None
        self.store.put_bytes(manifest_key(self.job_id, local.name), json.dumps(manifest).encode())  # LAST
        self.stored_step = manifest["step"]
        self.prune()
        log.info("job %s: checkpoint %s stored in %s (%d files)", self.job_id, local.name, self.store.url,
                 len(files))
        return local.name

    def prune(self) -> None:
        """Keep the newest `keep` stored checkpoints: an older one's manifest goes first, then its files (and the
        files of any older upload that never got its manifest)."""
        manifests = self._manifests()
        if not manifests:
            return
        kept = {key.rsplit("/", 1)[1].removesuffix(".json") for _, key in manifests[-self.keep:]}
        self.store.delete([key for _, key in manifests[:-self.keep]])
        newest = manifests[-1][0]
        prefix = checkpoint_key(self.job_id)
        stale = []
        for obj in self.store.list(prefix):
            folder = obj.key[len(prefix):].split("/", 1)[0]
            if folder not in kept and STEP.fullmatch(folder) and _step(folder) < newest:
                stale.append(obj.key)
        self.store.delete(stale)

    # --- at the end ----------------------------------------------------------------------------------------------
    def finish(self, *, succeeded: bool) -> dict | None:
        """The ranks are gone: store the last checkpoint and the artifacts, retrying up to store_wait_s. An error
        dict naming the store when a job that succeeded could not store them (it must not succeed without)."""
        self.close()
        try:
            self._retrying(self._store_last, what="storing the attempt's last checkpoint and artifacts")
        except StoreUnavailable as exc:
            log.error("job %s: %s", self.job_id, exc.message)
            if succeeded:
                return {"type": STORE_UNAVAILABLE, "rank": None, "message": f"{exc.message}: the job's artifacts "
                        f"could not be stored within store_wait_s={self.wait_s:g}s"}
        return None

    def _store_last(self) -> None:
        if self.checkpoints:
            self.upload_newest()
        self.upload_artifacts()

    def upload_artifacts(self) -> int:
        """Every regular file under the local artifacts folder (no link followed); returns how many."""
        if not (self.job_dir / paths.ARTIFACTS).is_dir() or self.stale():
            return 0
        return len(upload_tree(self.store, self.job_dir, paths.ARTIFACTS, lambda rel: artifact_key(self.job_id, rel)))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _retrying(self, action: Callable[[], None], *, what: str) -> None:
        deadline, wait = time.monotonic() + self.wait_s, BACKOFF_FIRST_S
        while True:
            try:
                return action()
            except StoreUnavailable as exc:
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("job %s: %s: %s; retrying in %.1fs", self.job_id, what, exc.message, wait)
                time.sleep(wait)
                wait = min(BACKOFF_MAX_S, wait * 2)


def upload_tree(store: Store, parent: Path, name: str, key_of: Callable[[str], str], *,
                whole: bool = False) -> dict[str, int]:
    """Every regular file under parent/name (links neither followed nor stored) as key_of(its path under it);
    returns each path and its size. FileNotFoundError if the folder is gone or, `whole`, a file of it went
    meanwhile (a checkpoint pruned under the upload must get no manifest)."""
    top = os.open(parent, _DIR)
    try:
        fd = os.open(name, _DIR, dir_fd=top)
    finally:
        os.close(top)
    files = {}
    try:
        for folder, _, names, folder_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for file_name in sorted(names):
                try:
                    file_fd = os.open(file_name, _FILE, dir_fd=folder_fd)
                except FileNotFoundError:
                    if whole:
                        raise
                    continue
                except OSError:  # a link (O_NOFOLLOW: ELOOP), a socket
                    continue
                with os.fdopen(file_fd, "rb") as file:
                    info = os.fstat(file_fd)
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    rel = Path(folder, file_name).as_posix().removeprefix("./")
                    store.put_file(key_of(rel), file)
                    files[rel] = info.st_size
    finally:
        os.close(fd)
    return files


def _step(name: str) -> int:
    return int(name[len(paths.CHECKPOINT_PREFIX):])
