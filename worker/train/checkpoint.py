"""Checkpoints with torch.distributed.checkpoint: sharded for FSDP, the same code path for DDP.

A checkpoint is a folder `step_00000120/` in the job's checkpoint dir holding the DCP shards (model
and optimizer), `trainer.json` (step, epoch, position in the epoch) and one RNG file per rank. It
counts only once rank 0 has written `COMPLETE`, after every rank finished writing: a job killed in
the middle of a save resumes from the one before.

Every pickle a load reads is read with weights_only=True first (tensors and plain values only): a checkpoint is
written by a job's ranks, and one job may load another's (spec.init_from). NOTE: DCP's own `.metadata` is
not: FileSystemReader.read_metadata unpickles it with pickle.load, and torch (2.13) offers no safe option.
"""

import io
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from trainjobs.paths import checkpoint_step, complete_checkpoints
from trainjobs.runenv import ATTEMPT_ENV
from worker.train.distributed import Dist

COMPLETE = "COMPLETE"
OWNER = "OWNER"  # in the job's folder: the attempt that may write checkpoints
PREFIX = "step_"


@dataclass
class Position:
    """Where training stands: enough to continue exactly where a checkpoint left off."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of this epoch already consumed


class VettedLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but a value that is not a tensor (the optimizer's param_groups: floats, tuples,
    strings) is first read with weights_only=True: the default reads it with the full unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # an UnpicklingError on anything but tensors and plain values
        value.seek(0)  # vetted: the full unpickler now reads the same bytes, so builds only what was allowed
        super().load_bytes(read_item, value)


class Checkpointer:
    def __init__(self, root: Path | None, d: Dist, *, every: int | None, keep: int):
        self.root, self.d, self.every, self.keep = root, d, every, keep

    def due(self, step: int) -> bool:
        return self.root is not None and self.every is not None and step % self.every == 0

    def agreed_latest(self) -> Path | None:
        """Collective: the newest checkpoint that every rank has complete under its own root, as a path there.

        Each node names its checkpoints by folder, never by rank 0's path: with a store, a gang's machines each
        keep their checkpoints under their own TRAINJOBS_STORAGE_DIR (one path per machine, and under a sandbox
        one node cannot see another's), and a machine may hold a newer one that the others never fetched (its
        part was never stored whole), which only some ranks could load.
        """
        names = {p.name for p in complete_checkpoints(self.root)} if self.root else set()
        every: list[set[str] | None] = [None] * self.d.world_size
        dist.all_gather_object(every, names)
        common = max(set.intersection(*every), key=checkpoint_step, default=None)
        mine = max(names, key=checkpoint_step, default=None)
        if self.d.is_main and mine is not None and mine != common:
            print(f"[trainjobs] checkpoint {mine} is not on every node: resuming from {common or 'scratch'}",
                  flush=True)
        return self.root / common if common else None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, position: Position) -> Path:
        """Collective: every rank calls it at the same step."""
        check_owner(self.root.parent, "a checkpoint")
        path = self.root / f"{PREFIX}{position.step:08d}"
        if self.d.local_rank == 0 and path.exists():  # a half-written one from an attempt that died saving
            shutil.rmtree(path, ignore_errors=True)  # on each node: a gang's may each have their own root
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        torch.save(_rng_state(), path / f"rng_rank{self.d.rank}.pt")
        if self.d.is_main:
            (path / "trainer.json").write_text(json.dumps(asdict(position)))
        dist.barrier()  # every rank has written its part
        if self.d.is_main:
            check_owner(self.root.parent, "a checkpoint")
            _write_atomic(path / COMPLETE, json.dumps({"step": position.step, "world_size": self.d.world_size}))
            self._prune()
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Position:
        """Collective: restore model, optimizer, this rank's RNG and the position from `path`."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, planner=VettedLoadPlanner())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{self.d.rank}.pt"
        if rng_file.is_file():  # absent when the world size changed: the seeds then differ anyway
            _set_rng_state(torch.load(rng_file, weights_only=True))  # tensors: see _rng_state
        return Position(**json.loads((path / "trainer.json").read_text()))

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop older and unfinished ones."""
        complete = complete_checkpoints(self.root)
        newest = int(complete[-1].name[len(PREFIX):])
        for path in complete[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(f"{PREFIX}*"):
            if not (path / COMPLETE).exists() and int(path.name[len(PREFIX):]) < newest:
                shutil.rmtree(path, ignore_errors=True)


def check_owner(job_dir: Path, what: str) -> None:
    """Fencing: once a newer attempt owns the job's folder (this one was paused past its lease and the
    job given away), this attempt must not write there. The supervisor writes OWNER at launch."""
    owner = job_dir / OWNER
    mine = os.environ.get(ATTEMPT_ENV)
    if mine and owner.is_file() and owner.read_text().strip() != mine:
        raise RuntimeError(f"attempt {mine} no longer owns the job (attempt {owner.read_text().strip()} does): "
                           f"not writing {what}")


def save_model(model: nn.Module, d: Dist, artifacts_dir: Path | None) -> Path | None:
    """Collective: gather the full state dict to rank 0, which writes `model.pt` (plain tensor names)."""
    if artifacts_dir is None:
        return None
    check_owner(artifacts_dir.parent, "model.pt")  # every rank reads it, so all stop before the gather
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return None
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    path = artifacts_dir / "model.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(full, tmp)
    check_owner(artifacts_dir.parent, "model.pt")  # the gather and the write take a while: look again
    os.replace(tmp, path)
    return path


def load_weights(model: nn.Module, source: Path) -> None:
    """Collective: another job's model weights into this one (spec.init_from), not its optimizer or step.

    `source` is a model.pt (a full state dict) or a checkpoint folder (DCP: only its model part is read). Every
    parameter must match by name and shape, else a ValueError names the first that does not.
    """
    expected = get_model_state_dict(model)  # names without DDP's prefix; FSDP's DTensors have the global shape
    if source.is_dir():
        metadata = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata
        found = {k.removeprefix("model."): tuple(v.size) for k, v in metadata.items()
                 if k.startswith("model.") and hasattr(v, "size")}
    else:
        full = torch.load(source, map_location="cpu", weights_only=True)
        found = {k: tuple(v.shape) for k, v in full.items()}
    for name, tensor in expected.items():
        if name not in found:
            raise ValueError(f"init_from: parameter {name!r} of this model is not in {source}")
        if found[name] != tuple(tensor.shape):
            raise ValueError(f"init_from: parameter {name!r} is {list(found[name])} in {source}, "
                             f"{list(tensor.shape)} in this model")
    if extra := sorted(set(found) - set(expected)):
        raise ValueError(f"init_from: {source} has parameter {extra[0]!r}, which this model lacks")
    if source.is_dir():
        state = {"model": expected}
        dcp.load(state, checkpoint_id=source, planner=VettedLoadPlanner())
        set_model_state_dict(model, state["model"])
    else:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def _rng_state() -> dict:
    """This rank's generators' states: byte tensors only, so that a resume reads them with weights_only=True."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
