"""Model FLOPs utilisation: the FLOPs the model needs per sample over what the devices could do.

The devices' peaks are trainjobs/peaks.py's table (shared with a user's script's report(flops_per_step=...)).
"""

from trainjobs.peaks import PEAK_FLOPS_ENV, peak_flops
from trainjobs.peaks import mfu as mfu_of
from trainjobs.spec import GPTConfig, MLPConfig

__all__ = ["PEAK_FLOPS_ENV", "flops_per_sample", "mfu", "peak_flops"]


def flops_per_sample(cfg: MLPConfig | GPTConfig, n_params: int, embedding_params: int) -> float:
    """Training FLOPs (forward + backward) for one sample.

    6 per non-embedding parameter per token (2 forward, 4 backward; embedding lookups cost nothing),
    plus, for attention, 12 * n_layer * d_model * seq_len per token (PaLM, appendix B: QK^T and AV, each
    2 * seq_len * d_model forward, times 3 with backward, over the causal mask's full square as the kernels
    compute it).
    """
    dense = 6 * (n_params - embedding_params)
    if cfg.type == "mlp":
        return float(dense)
    per_token = dense + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    return float(per_token * cfg.seq_len)


def mfu(samples_per_s: float, flops_sample: float, peak: float, world_size: int) -> float:
    return mfu_of(samples_per_s * flops_sample, peak, world_size)
