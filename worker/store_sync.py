"""An attempt's checkpoints and artifacts to and from the object store (issue 31): the worker's, never the ranks'.

The ranks write checkpoints on local disk as without a store (fast, and no credentials in the job's sandbox);
a thread of the supervisor uploads each new complete one while training goes on, then writes its manifest
(`jobs/<id>/checkpoint-manifests/step_N.json`: every file and its size) last. Only a checkpoint with a manifest
counts: an upload cut off half-way leaves the one before the latest. Retention keeps the newest
`train.keep_checkpoints` (a manifest is deleted before its files). Before launch, an attempt whose local folder
lacks the store's newest checkpoint downloads it (beside, then renamed into place). At the end the last
checkpoint and the artifacts are stored, retried up to `store_wait_s`; a job whose artifacts could not be stored
fails naming the store rather than succeeding without them.

A gang's nodes each store their own part of a checkpoint (worker/store_gang.py), and the manifest once every part
is in. A resume downloads the whole checkpoint on every node that lacks it whole: DCP's loader reads an item from
whichever rank's file holds it (a replicated tensor is saved once, by one rank).

A user's script (entrypoint) syncs the same way the checkpoints it writes as `TRAINJOBS_CHECKPOINT_DIR/step_N/`
marked whole by COMPLETE (trainjobs.complete_checkpoint) or by DCP's own `.metadata` (paths.SCRIPT_MARKS).

While the store is out of reach the job's events say so (`store_waiting`, then `store_back` once a checkpoint is
stored again), so a user sees why its checkpoints lag.

NOTE: the ranks write these folders, so a file in them may be a link planted to make the worker (root) upload
something else: every file is opened from its folder's descriptor with O_NOFOLLOW (service/storage/tree.py).
"""

import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service import jobfiles
from service.packages import stored as package_store
from service.runners.ship_calls import EVENT_DETAIL_MAX
from service.settings import Settings
from service.storage import StoreUnavailable, artifact_key, open_store
from service.storage.store import Store, checkpoint_key, manifest_key, part_key
from service.storage.tree import upload_tree
from trainjobs import paths
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType
from worker.control import Control, Unreachable
from worker.lease import Lease
from worker.packages import PackageUnavailable
from worker.store_gang import GangParts, folders, identity, marked, prune_copies

log = logging.getLogger(__name__)
STORE_UNAVAILABLE = ErrorType.STORE_UNAVAILABLE  # the job's error type when the store kept its artifacts out
SCAN_S = 1.0  # how often the upload thread looks for a new complete checkpoint
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 15.0
LAST_PART_WAIT_S = 30.0  # at a gang node's end, how long it waits for node 0's part of the last checkpoint
WAITING, BACK = "store_waiting", "store_back"  # the job's events while its checkpoints wait for the store
STEP = re.compile(rf"{paths.CHECKPOINT_PREFIX}(\d+)")


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
                lease: Lease | None = None, note: Callable[[str, str], None] | None = None) -> "AttemptSync | NoSync":
    """The attempt's sync, or NoSync without a store. `lease`: once it is lost (or, as far as this worker knows,
    run out) the attempt stores nothing more: fencing across machines, where the job folder's OWNER file is only
    local; and its tick while the supervisor waits on the store. `note(kind, detail)`: records a job event
    (event_writer; none: only the worker's log says the store is out of reach)."""
    store = open_store(settings)
    if store is None:
        return NoSync()
    return AttemptSync(store, job_id=job_id, job_dir=job_dir, keep=spec.train.keep_checkpoints,
                       wait_s=settings.store_wait_s, node_rank=node_rank,
                       marks=paths.SCRIPT_MARKS if spec.entrypoint is not None else (paths.CHECKPOINT_COMPLETE,),
                       nnodes=spec.resources.nnodes if gang else 1,
                       note=note,
                       **({} if lease is None else {
                           "stale": lambda: lease.lost or lease.expired, "lost": lambda: lease.lost,
                           # one request's worst (botocore's 3 tries of connect and read) and one backoff's sleep
                           "alive": lambda: lease.tick(busy_s=6 * settings.store_timeout_s + BACKOFF_MAX_S)}))


def event_writer(control: Control, *, job_id: str, attempt: int, node_rank: int, seq: int = 0
                 ) -> Callable[[str, str], None]:
    """A job event per call, through the worker protocol's `event` (service/runners/ship_calls.py), numbered after
    `seq` (the attempt's last one stored): sent again once when the control plane did not answer, and stored once
    however often it is sent. One out of reach twice loses the event, never the upload."""
    numbers, lock = itertools.count(seq + 1), threading.Lock()

    def note(kind: str, detail: str) -> None:
        with lock:  # the upload thread and the supervisor's: numbered in the order they are sent
            body = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank, "seq": next(numbers),
                    "kind": kind, "detail": detail[:EVENT_DETAIL_MAX]}
            for last_try in (False, True):
                try:
                    control.call("event", body)
                    return
                except Unreachable as exc:
                    if last_try:
                        log.warning("job %s: could not record %s: %s", job_id, kind, exc)
                except Exception as exc:  # noqa: BLE001 - an event is a courtesy: the store's state is in the log too
                    log.warning("job %s: could not record %s: %s", job_id, kind, exc)
                    return
    return note


class AttemptSync:
    def __init__(self, store: Store, *, job_id: str, job_dir: Path, keep: int, wait_s: float,
                 marks: tuple[str, ...] = (paths.CHECKPOINT_COMPLETE,), node_rank: int = 0, nnodes: int = 1,
                 stale: Callable[[], bool] = lambda: False, lost: Callable[[], bool] = lambda: False,
                 note: Callable[[str, str], None] | None = None, alive: Callable[[], None] | None = None):
        self.store, self.job_id, self.job_dir, self.keep, self.wait_s = store, job_id, job_dir, keep, wait_s
        self.node_rank, self.nnodes, self.stale, self.lost = node_rank, nnodes, stale, lost
        self.note = note or (lambda kind, detail: None)
        self.alive = alive or (lambda: None)
        self._waited_on = False  # the supervisor waits on the store (before launch, at the end): keep its lease
        self.marks = marks  # the files that say a local step_N folder is whole (see paths.SCRIPT_MARKS)
        self.root = job_dir / paths.CHECKPOINTS
        self.gang = GangParts(store, job_id=job_id, node_rank=node_rank, nnodes=nnodes, marks=marks) \
            if nnodes > 1 else None
        self.found_at_start: dict[str, tuple[int, int]] = {}  # local folders before the ranks ran: not theirs
        self.stored_step = -1  # the newest checkpoint this node stored (its part, in a gang), or found stored
        self.waiting = False  # the store is out of reach: the job's events said so, and say when it is back
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- before launch -------------------------------------------------------------------------------------------
    def restore(self) -> dict | None:
        """The store's newest checkpoint into the local folder, where it lacks it; an error dict if the store
        stays out of reach for store_wait_s (the attempt then fails, retryable, rather than start from scratch)."""
        try:
            self._retrying(self._restore, what="fetching the newest checkpoint")
        except StoreUnavailable as exc:
            return {"type": STORE_UNAVAILABLE, "rank": None, "message": f"{exc.message}: the job's newest "
                    f"checkpoint could not be fetched within store_wait_s={self.wait_s:g}s"}
        return None

    def _restore(self) -> None:
        newest = self.newest_manifest()
        if self.gang is not None:
            self.gang.drop_unsealed(after=newest["step"] if newest else -1)
        if newest is None:
            return
        self.stored_step = newest["step"]
        if self._have(newest["name"]):
            return
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        # NOTE: staged in the service's own folder, not the job's, where an earlier attempt may have planted a link
        # at the staging name to take this (root's) download anywhere; then moved in by descriptor (jobfiles.place).
        staging = jobfiles.staging(self.job_dir.parent.parent) / f"{self.job_id}-{newest['name']}-node{self.node_rank}"
        shutil.rmtree(staging, ignore_errors=True)
        for rel, size in newest["files"].items():
            self._tick()
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.store.get_file(checkpoint_key(self.job_id, newest["name"], rel), dest)
            if dest.stat().st_size != size:
                raise StoreUnavailable(f"the store {self.store.url} gave {rel} of {newest['name']} with "
                                       f"{dest.stat().st_size} bytes, its manifest says {size}")
        final = root / newest["name"]
        if self._whole(final):  # another node of a gang sharing this folder was first
            shutil.rmtree(staging, ignore_errors=True)
            return
        jobfiles.place(staging, root, newest["name"])  # over a half-written one of an attempt that died here
        owner = root.stat()
        if owner.st_uid != os.geteuid():  # the job's uid's folder (sandbox.hand_over): it may prune this one too
            for path in (final, *final.rglob("*")):
                os.lchown(path, owner.st_uid, owner.st_gid)
        log.info("job %s: checkpoint %s fetched from %s", self.job_id, newest["name"], self.store.url)

    def _have(self, name: str) -> bool:
        """Whether this machine holds the store's newest checkpoint whole, or (alone) a newer one: a gang's nodes
        resume from one they all hold (worker/train/checkpoint.py), so a newer one of one node's does not do."""
        local = self._newest_whole()
        return local is not None and (local.name == name if self.nnodes > 1 else _step(local.name) >= _step(name))

    def _newest_whole(self) -> Path | None:
        found = paths.complete_checkpoints(self.root, self.marks)
        return found[-1] if found else None

    def _whole(self, folder: Path) -> bool:
        return any(jobfiles.is_real(folder.parent, f"{folder.name}/{mark}") for mark in self.marks)

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
        self.found_at_start = {p.name: identity(p) for p in folders(self.root)}
        self._thread = threading.Thread(target=self._loop, name=f"store-sync-{self.job_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        _in_the_background()
        wait, failures = SCAN_S, 0
        while not self._stop.wait(wait):
            try:
                self.upload_newest()
                wait, failures = SCAN_S, 0
            except StoreUnavailable as exc:  # the job trains on; its checkpoint waits for the store
                failures += 1
                wait = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
                log.warning("job %s: %s; retrying in %.1fs", self.job_id, exc.message, wait)
                self._note_waiting(f"{exc.message}: the job trains on, its checkpoints wait (retried with backoff)")
            except Exception:  # noqa: BLE001 - an upload bug must never end a healthy run
                log.exception("job %s: storing a checkpoint failed", self.job_id)
                wait = BACKOFF_MAX_S

    def upload_newest(self) -> str | None:
        """The newest local checkpoint this node may store, if newer than the one it stored: every file, then its
        manifest (a gang's node: its part, then the manifest once every node's part is in), then retention.
        Returns its name, or None when there was nothing new."""
        local = self._ready()
        if local is None or self.stale():
            return None
        lead = self._whole(local)
        try:
            files = upload_tree(self.store, self.root, local.name,
                                lambda rel: checkpoint_key(self.job_id, local.name, rel), whole=True,
                                each=self._tick)
        except FileNotFoundError:  # pruned by the ranks meanwhile: a newer one is there
            return None
        now = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and not p.is_symlink()}
        if now != set(files) or (lead and not marked(files, self.marks)):
            return None  # pruned under the upload
        if self.stale():
            return None
        if self.gang is None:
            self._write_manifest(local.name, files)
        else:
            self.gang.put(local.name, files)
            if (every := self.gang.union(local.name)) is not None:
                self._write_manifest(local.name, every)
            if self._fresh(local):  # the ranks wrote it: they are past loading any older one
                prune_copies(self.root, keep=self.keep, upto=_step(local.name))
        self.stored_step = _step(local.name)
        log.info("job %s: checkpoint %s stored in %s (%d files of node %d)", self.job_id, local.name,
                 self.store.url, len(files), self.node_rank)
        if self.waiting:
            self.waiting = False
            self.note(BACK, f"the store {self.store.url} answers again: checkpoint {local.name} stored")
        return local.name

    def _ready(self) -> Path | None:
        """The newest local checkpoint newer than the one stored whose files are all written: one this node holds
        whole (its mark is written last); in a gang, else one whose lead's part is stored (the lead's mark is
        written after every rank's barrier, so this node's ranks had written theirs)."""
        whole = self._newest_whole()
        if self.gang is None:
            return whole if whole is not None and _step(whole.name) > self.stored_step else None
        if whole is not None and _step(whole.name) > self.stored_step and self._fresh(whole):
            return whole
        ready = self.gang.ready(self.root, after=self.stored_step)
        return ready if ready is not None and self._fresh(ready) else None

    def _fresh(self, folder: Path) -> bool:
        """Written by this attempt's ranks, not left by an earlier attempt (see worker/store_gang.py)."""
        try:
            return self.found_at_start.get(folder.name) != identity(folder)
        except FileNotFoundError:  # pruned meanwhile
            return False

    def _write_manifest(self, name: str, files: dict[str, int]) -> None:
        manifest = {"name": name, "step": _step(name), "files": files, "nodes": self.nnodes, "stored_at": time.time()}
        self.store.put_bytes(manifest_key(self.job_id, name), json.dumps(manifest).encode())  # LAST
        self.prune()

    def prune(self) -> None:
        """Keep the newest `keep` stored checkpoints: an older one's manifest goes first, then its files (and the
        files of any older upload that never got its manifest)."""
        manifests = self._manifests()
        if not manifests:
            return
        kept = {key.rsplit("/", 1)[1].removesuffix(".json") for _, key in manifests[-self.keep:]}
        self.store.delete([key for _, key in manifests[:-self.keep]])
        newest = manifests[-1][0]
        stale = []
        for prefix in (checkpoint_key(self.job_id), part_key(self.job_id)):
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
        if not self._confirm_lease():
            log.error("job %s: its lease is not confirmed: its last checkpoint and artifacts are not stored",
                      self.job_id)
            if succeeded and not self.lost():  # lost: the outcome is not this attempt's to record anyway
                return {"type": STORE_UNAVAILABLE, "rank": None, "message": "the attempt's lease could not be "
                        f"confirmed within store_wait_s={self.wait_s:g}s: its artifacts were not stored"}
            return None
        try:
            self._retrying(self._store_last, what="storing the attempt's last checkpoint and artifacts")
            if succeeded and self.nnodes > 1:
                self._retrying(self._store_last_part, what="storing this node's part of the last checkpoint")
        except StoreUnavailable as exc:
            log.error("job %s: %s", self.job_id, exc.message)
            if succeeded:
                return {"type": STORE_UNAVAILABLE, "rank": None, "message": f"{exc.message}: the job's artifacts "
                        f"could not be stored within store_wait_s={self.wait_s:g}s"}
        return None

    def _confirm_lease(self) -> bool:
        """Whether the attempt still holds the job. A lease this worker merely sees run out (a renewal the database
        was too slow for) is waited on, up to store_wait_s: storing nothing would let the job succeed without its
        artifacts in the store."""
        deadline = time.monotonic() + self.wait_s
        self._waited_on = True
        try:
            while self.stale() and not self.lost() and time.monotonic() < deadline:
                self._tick()
                time.sleep(0.2)
        finally:
            self._waited_on = False
        return not self.stale()

    def _store_last(self) -> None:
        self.upload_newest()
        self.upload_artifacts()  # every node's: global rank 0, which writes model.pt, may run on any node

    def _store_last_part(self) -> None:
        """A gang's node: its part of the last checkpoint, once the lead's is in (the lead may end later)."""
        found = [folder for folder in folders(self.root) if self._fresh(folder)]  # what this attempt saved
        newest = _step(found[-1].name) if found else -1
        deadline = time.monotonic() + min(self.wait_s, LAST_PART_WAIT_S)
        while self.stored_step < newest and time.monotonic() < deadline and not self.stale():
            self._tick()
            self.upload_newest()
            time.sleep(SCAN_S)

    def upload_artifacts(self) -> int:
        """Every regular file under the local artifacts folder (no link followed); returns how many."""
        if not (self.job_dir / paths.ARTIFACTS).is_dir() or self.stale():
            return 0
        return len(upload_tree(self.store, self.job_dir, paths.ARTIFACTS, lambda rel: artifact_key(self.job_id, rel),
                               each=self._tick))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _retrying(self, action: Callable[[], None], *, what: str) -> None:
        deadline, wait = time.monotonic() + self.wait_s, BACKOFF_FIRST_S
        self._waited_on = True
        try:
            self._retry(action, what=what, deadline=deadline, wait=wait)
        finally:
            self._waited_on = False

    def _retry(self, action: Callable[[], None], *, what: str, deadline: float, wait: float) -> None:
        while True:
            self._tick()
            try:
                action()
            except StoreUnavailable as exc:
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("job %s: %s: %s; retrying in %.1fs", self.job_id, what, exc.message, wait)
                self._note_waiting(f"{exc.message}: {what}, retried up to store_wait_s={self.wait_s:g}s")
                time.sleep(wait)
                wait = min(BACKOFF_MAX_S, wait * 2)
            else:
                if self.waiting:
                    self.waiting = False
                    self.note(BACK, f"the store {self.store.url} answers again: {what} done")
                return


    def _tick(self) -> None:
        """The lease's tick while the supervisor waits on the store; never from the background thread, whose
        uploads must not hide a stuck supervisor."""
        if self._waited_on:
            self.alive()

    def _note_waiting(self, detail: str) -> None:
        if not self.waiting:  # once per outage, not once per retry
            self.waiting = True
            self.note(WAITING, detail)


def fetch_package(settings: Settings, digest: str, archive: Path) -> None:
    """A job's package from the store into this machine's storage dir, where it lacks it (no-op without a store);
    the store out of reach, or giving other bytes, makes the package unavailable to this attempt."""
    try:
        package_store.fetch(settings, digest, archive)
    except StoreUnavailable as exc:
        raise PackageUnavailable(f"package {digest}: {exc.message}") from None


def _step(name: str) -> int:
    return int(name[len(paths.CHECKPOINT_PREFIX):])


def _in_the_background() -> None:
    """The calling thread runs only on CPU time nothing else wants (SCHED_IDLE): an upload (hashing, TLS, copying)
    never takes a core from the job's ranks, whose step time it would otherwise cost on a busy machine."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux schedules threads)
    except (AttributeError, OSError) as exc:
        log.info("uploads run at normal priority: %s", exc)
