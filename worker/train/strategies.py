"""Wrap a model for its strategy. One place holds each policy; models only say what they are."""

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from worker.train.distributed import Dist


def apply_strategy(model: nn.Module, strategy: str, d: Dist) -> nn.Module:
    model = model.to(d.device)
    if strategy == "ddp":
        # DDP broadcasts rank 0's parameters at construction and averages gradients in backward.
        return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    raise ValueError(f"strategy {strategy!r} is not supported by this worker")
