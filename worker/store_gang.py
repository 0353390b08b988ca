"""A gang's checkpoints in the object store, node by node (issue 31): the parts that worker/store_sync.py adds up.

Each node of a gang holds its own ranks' files of a checkpoint, under its own TRAINJOBS_STORAGE_DIR (one path per
machine, never shared). The lead of a checkpoint is the node whose folder of it holds the mark (COMPLETE, written
by global rank 0 after every rank's barrier; c10d may give that rank to any node): it stores its part at once;
every other node stores its part once the lead's is in the store (its own ranks had written theirs by then), and
each writes a part list (`jobs/<id>/checkpoint-parts/step_N/node_K.json`). Whichever node sees every node's part
writes the manifest, the union of the parts.

A folder an earlier attempt left on this machine is never stored (nor a stored part of it used): this attempt's
nodes may not hold the same save of it. Global rank 0 prunes only its own node's folder, so each node also drops
its own copies past keep_checkpoints once it stored a newer part, never one it may still have to store.
"""

import json
import shutil
from pathlib import Path

from service.storage.store import Store, manifest_key, part_key
from trainjobs import paths


class GangParts:
    def __init__(self, store: Store, *, job_id: str, node_rank: int, nnodes: int, marks: tuple[str, ...]):
        self.store, self.job_id, self.node_rank, self.nnodes, self.marks = store, job_id, node_rank, nnodes, marks
        self.led: set[str] = set()  # checkpoints whose lead's part this node saw stored

    def ready(self, root: Path, *, after: int) -> Path | None:
        """This node's newest folder of a checkpoint newer than step `after` whose lead's part is stored."""
        prefix = part_key(self.job_id)
        names = {o.key[len(prefix):].split("/", 1)[0] for o in self.store.list(prefix)}
        newer = sorted((n for n in names if (step := paths.checkpoint_step(n)) is not None and step > after
                        and (root / n).is_dir()), key=paths.checkpoint_step, reverse=True)
        return next((root / name for name in newer if self._lead_stored(name)), None)

    def _lead_stored(self, name: str) -> bool:
        """Whether another node's stored part of checkpoint `name` holds the mark (read once per checkpoint)."""
        for node in range(self.nnodes):
            if name in self.led or node == self.node_rank:
                continue
            try:
                files = json.loads(self.store.get_bytes(part_key(self.job_id, name, node)))["files"]
            except FileNotFoundError:
                continue
            if marked(files, self.marks):
                self.led.add(name)
        return name in self.led

    def drop_unsealed(self, *, after: int) -> None:
        """Before launch: the parts of checkpoints newer than step `after` (the store's newest) that an earlier
        attempt stored but never sealed. No rank of this attempt saved yet (they wait for every node to join), and
        a stale lead's part must not pair with a part this attempt writes under the same name."""
        prefix = part_key(self.job_id)
        self.store.delete([o.key for o in self.store.list(prefix)
                           if (step := paths.checkpoint_step(o.key[len(prefix):].split("/", 1)[0])) is not None
                           and step > after])

    def put(self, name: str, files: dict[str, int]) -> None:
        """This node's part of checkpoint `name`: its files (already in the store) and their sizes."""
        part = {"node_rank": self.node_rank, "files": files}
        self.store.put_bytes(part_key(self.job_id, name, self.node_rank), json.dumps(part).encode())

    def union(self, name: str) -> dict[str, int] | None:
        """Every node's files of checkpoint `name` once all their parts are in (the lead's with the mark), for its
        manifest; None while one is missing, or once another node wrote the manifest."""
        if self.store.head(manifest_key(self.job_id, name)) is not None:
            return None
        files: dict[str, int] = {}
        for node in range(self.nnodes):
            try:
                files.update(json.loads(self.store.get_bytes(part_key(self.job_id, name, node)))["files"])
            except FileNotFoundError:
                return None  # that node's part is not in yet: it writes the manifest when it is
        return files if marked(files, self.marks) else None


def marked(files: dict[str, int] | set[str], marks: tuple[str, ...]) -> bool:
    return any(mark in files for mark in marks)


def folders(root: Path) -> list[Path]:
    """This machine's checkpoint folders of a job, whole or not, oldest first."""
    found = [p for p in root.glob(f"{paths.CHECKPOINT_PREFIX}*") if paths.checkpoint_step(p.name) is not None] \
        if root.is_dir() else []
    return sorted(found, key=lambda p: paths.checkpoint_step(p.name))


def identity(folder: Path) -> tuple[int, int]:
    """Which folder this is: a checkpoint saved again under the same name is a new folder (the ranks remove the old)."""
    info = folder.stat()
    return info.st_ino, info.st_ctime_ns


def prune_copies(root: Path, *, keep: int, upto: int) -> None:
    """This node's folders past the newest `keep`, of step `upto` (just stored) or older: a node stores only its
    newest ready checkpoint, so none older than the one it stored is still to be uploaded."""
    for folder in folders(root)[:-keep]:
        if paths.checkpoint_step(folder.name) <= upto:
            shutil.rmtree(folder, ignore_errors=True)
