"""All the distributed boilerplate: one init, one cleanup (as nanochat's compute_init/cleanup)."""

import os
import resource
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker import processes


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def die_with_torchrun() -> None:
    """A rank whose torchrun is gone (SIGKILLed with its worker) must not train on as an orphan."""
    parent = os.getppid()
    processes.die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def init_distributed(device_kind: str) -> Dist:
    """Join the process group torchrun set up: nccl on CUDA, gloo on CPU."""
    die_with_torchrun()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device_kind == "auto":
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("resources.device is 'cuda' but this worker has no CUDA device")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} needs a GPU; this node has {torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def mean_across_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over all ranks (a collective: every rank must call it)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cleanup_and_exit(code: int = 0) -> None:
    """Destroy the process group, then leave with os._exit.

    NOTE: on torch 2.13, 5-20% of gloo runs abort *after* a clean destroy_process_group
    ("terminate called without an active exception", exit -6) while static destructors run.
    Everything is flushed and the group is gone by then, so skip the interpreter's teardown.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
