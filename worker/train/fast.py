"""The fast path on CUDA, as torchtitan runs: TF32 matmuls, bf16 autocast for DDP, fused AdamW, torch.compile.

CPU runs take none of it unless asked (train.compile true): gloo jobs are tests and small runs, whose losses must
match a one-process run exactly, and inductor's C++ compile costs more than it saves there.
"""

import contextlib

import torch
from torch import nn

from trainjobs.spec import JobSpec


def use_compile(spec: JobSpec, device: torch.device) -> bool:
    """train.compile, or by default: on for CUDA, off for CPU."""
    return spec.train.compile if spec.train.compile is not None else device.type == "cuda"


def set_matmul_precision(device: torch.device) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (10 mantissa bits: what every fast trainer runs)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def autocast_dtype(spec: JobSpec, device: torch.device) -> torch.dtype | None:
    """DDP's forward precision: bf16 autocast on a CUDA device that has it (FSDP casts by its own policy)."""
    if device.type != "cuda" or spec.strategy != "ddp" or not spec.train.autocast:
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else None


def forward_context(dtype: torch.dtype | None):
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def matmul_precision(spec: JobSpec, device: torch.device) -> str:
    """What the model's matmuls run in, for the device's peak: bf16, fp16, tf32 (fp32 on CUDA is TF32 here) or fp32."""
    if spec.strategy == "fsdp":
        precision = spec.fsdp.mixed_precision or ("bf16" if device.type == "cuda" else "fp32")
    else:
        precision = "bf16" if autocast_dtype(spec, device) is not None else "fp32"
    return "tf32" if precision == "fp32" and device.type == "cuda" else precision


def compile_blocks(model: nn.Module, backend: str) -> None:
    """Each block of `model.layers` compiled in place, before FSDP shards it (torchtitan's order).

    Module.compile keeps the module and its parameter names (torch.compile(module) would prefix them with
    `_orig_mod.`), so checkpoints and model.pt read the same with compile on and off. FSDP2's hooks run
    outside the compiled graph (dynamo skips them); the blocks share their code, so one graph serves them all.
    """
    for block in model.layers:
        block.compile(backend=backend)


def compile_whole(model: nn.Module, backend: str) -> None:
    """The DDP-wrapped model compiled in place: dynamo splits the graph at DDP's buckets so all-reduce overlaps."""
    model.compile(backend=backend)
