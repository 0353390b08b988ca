"""Optimizers and the learning-rate schedule from the spec."""

import math

import torch
from torch import nn

from trainjobs.spec import OptimizerConfig


def build_optimizer(cfg: OptimizerConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if cfg.type == "adamw":
        # Fused on CUDA: one kernel for every parameter's update. CPU keeps the default (foreach), whose
        # numbers the equivalence tests pin.
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                 fused=device.type == "cuda" or None)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_at(cfg: OptimizerConfig, step: int, max_steps: int) -> float:
    """Linear warmup, then constant or cosine decay to 10% of lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
