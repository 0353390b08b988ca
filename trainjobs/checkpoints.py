"""Checkpoints from your own training script (entrypoint mode) that the service keeps and resumes from.

    import trainjobs

    latest = trainjobs.latest_checkpoint()        # at start: the newest whole checkpoint (a resume), or None
    ...
    path = trainjobs.checkpoint_path(step)        # TRAINJOBS_CHECKPOINT_DIR/step_00000500/
    dcp.save(state, checkpoint_id=path)           # torch.distributed.checkpoint (or torch.save into the folder)
    dist.barrier()                                # every rank has written its files
    trainjobs.complete_checkpoint(path)           # global rank 0 writes COMPLETE: now the checkpoint counts

A checkpoint is a folder `step_N` in the job's checkpoint dir, whole once it holds COMPLETE, or the `.metadata`
that torch.distributed.checkpoint writes last (a folder of DCP's files alone may skip complete_checkpoint). With
an object store (TRAINJOBS_STORAGE_URL) the worker uploads each whole one while the script trains on, keeps the
newest `train.keep_checkpoints` there, and before a resume on another machine puts the store's newest one back
here, where latest_checkpoint() finds it. Any other file in the checkpoint dir stays on this machine.

NOTE: in a multi-node job each machine has its own folder with a store: a node that resumes finds the store's
newest one, and the node of global rank 0 may also hold a newer one of its own that was never stored whole. Load
one every rank has (all_gather the names, take the newest common), as the built-in runtime does.
Outside the service (no TRAINJOBS_CHECKPOINT_DIR) every helper returns None and does nothing.
"""

import os
from pathlib import Path

from trainjobs.paths import CHECKPOINT_COMPLETE, CHECKPOINT_PREFIX, SCRIPT_MARKS, checkpoint_step, complete_checkpoints
from trainjobs.reporting import checkpoint_dir

__all__ = ["checkpoint_path", "complete_checkpoint", "latest_checkpoint"]


def checkpoint_path(step: int) -> Path | None:
    """The folder for the checkpoint of `step` (made), or None outside the service."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    root = checkpoint_dir()
    if root is None:
        return None
    path = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def complete_checkpoint(path: Path | str | None) -> None:
    """Mark a checkpoint whole (COMPLETE, written last): call it on every rank after a barrier that follows every
    rank's writes; global rank 0 writes the mark, the others do nothing."""
    if path is None or os.environ.get("RANK", "0") != "0":
        return
    path, root = Path(path), checkpoint_dir()
    if root is None:
        return
    if path.parent.resolve() != root.resolve() or checkpoint_step(path.name) is None:
        raise ValueError(f"{path} is not a checkpoint folder of this job: use trainjobs.checkpoint_path(step)")
    temp = path / f"{CHECKPOINT_COMPLETE}.tmp"
    temp.write_text(f"{checkpoint_step(path.name)}\n")
    os.replace(temp, path / CHECKPOINT_COMPLETE)


def latest_checkpoint() -> Path | None:
    """The newest whole checkpoint in the job's checkpoint dir (its own, or the store's put back), or None."""
    root = checkpoint_dir()
    found = complete_checkpoints(root, SCRIPT_MARKS) if root is not None else []
    return found[-1] if found else None
