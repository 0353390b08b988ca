"""Wrap a model for its strategy. One place holds each policy; models only say what they are."""

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from trainjobs.spec import FSDPConfig
from worker.train.distributed import Dist
from worker.train.fast import compile_blocks, compile_whole

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def apply_strategy(model: nn.Module, strategy: str, d: Dist, fsdp: FSDPConfig, *,
                   compile_backend: str | None = None) -> nn.Module:
    """The model on its device under `strategy`; compiled with `compile_backend` unless it is None."""
    model = model.to(d.device)
    if strategy == "ddp":
        # DDP broadcasts rank 0's parameters at construction and averages gradients in backward.
        ddp = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
        if compile_backend:
            compile_whole(ddp, compile_backend)
        return ddp
    if strategy == "fsdp":
        return apply_fsdp(model, d, fsdp, compile_backend=compile_backend)
    raise ValueError(f"strategy {strategy!r} is not supported by this worker")


def apply_fsdp(model: nn.Module, d: Dist, cfg: FSDPConfig, *, compile_backend: str | None = None) -> nn.Module:
    """FSDP2: shard each block of `model.layers`, then the root (embeddings, head, the rest).

    Every rank starts from the same seeded weights, so sharding them needs no broadcast.
    """
    precision = cfg.mixed_precision or ("bf16" if d.device.type == "cuda" else "fp32")
    # Gradients are reduced in fp32 whatever the compute precision: the average stays exact enough.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    offload = OffloadPolicy()
    if cfg.cpu_offload:
        if d.device.type == "cuda":
            offload = CPUOffloadPolicy()
        elif d.is_main:
            print("[trainjobs] fsdp.cpu_offload ignored: this job runs on CPU", flush=True)
    if cfg.activation_checkpointing:
        # NOTE: the wrapper strips its own prefix from state dict keys, so checkpoints and the final
        # model file have the same names with and without it.
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if compile_backend:
        compile_blocks(model, compile_backend)
    for block in model.layers:
        fully_shard(block, mp_policy=mp, offload_policy=offload, reshard_after_forward=cfg.reshard_after_forward)
    # The root's parameters are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return model
