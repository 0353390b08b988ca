"""Model FLOPs utilisation: the FLOPs the model needs per token over what the devices could do."""

import os

from trainjobs.spec import GPTConfig, MLPConfig

PEAK_FLOPS_ENV = "TRAINJOBS_PEAK_FLOPS"  # per device; overrides the table below
# Dense bf16 tensor-core peaks per device (no sparsity), from the vendors' data sheets.
PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "A10": 125e12,
    "RTX 4090": 165e12, "V100": 125e12,
}


def flops_per_sample(cfg: MLPConfig | GPTConfig, n_params: int, embedding_params: int) -> float:
    """Training FLOPs (forward + backward) for one sample.

    6 per non-embedding parameter per token (2 forward, 4 backward; embedding lookups cost nothing),
    plus, for attention, 12 * n_layer * d_model * seq_len per token (PaLM, appendix B).
    """
    dense = 6 * (n_params - embedding_params)
    if cfg.type == "mlp":
        return float(dense)
    per_token = dense + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    return float(per_token * cfg.seq_len)


def peak_flops(device_name: str) -> float | None:
    """The device's peak bf16 FLOP/s, or None when unknown (then no mfu is reported)."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    # Longest key first, so "A100" is not taken for "A10".
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in device_name.upper():
            return PEAK_BF16[key]
    return None


def mfu(samples_per_s: float, flops_sample: float, peak: float, world_size: int) -> float:
    return samples_per_s * flops_sample / (peak * world_size)
