"""Devices' peak FLOP/s by name, and MFU against them: arithmetic only (the runtime and a user's script share it).

Dense tensor-core peaks per device (no 2:4 sparsity), from the vendors' data sheets: NVIDIA H100/H200 (SXM,
PCIe, NVL), GH200, B200 (HGX), A100/A800, A10, A10G (AWS's G5 page), L4, L40, L40S, RTX 4090 (Ada whitepaper,
FP32 accumulate), V100 and T4 (no bf16 or tf32 units: no such peak). A device not in the table gets no MFU
rather than a wrong one (nanoGPT's hard-coded A100 peak shows 104% on an H100, nanoGPT#464).
"""

import os

PEAK_FLOPS_ENV = "TRAINJOBS_PEAK_FLOPS"  # per device, the worker's setting: overrides the table for every precision
T = 1e12
# name fragment (upper case) -> {precision: dense FLOP/s}; a longer fragment is tried first ("H100 PCIE" before
# "H100", "A100" before "A10").
PEAKS: dict[str, dict[str, float]] = {
    "H100 PCIE": {"bf16": 756 * T, "fp16": 756 * T, "tf32": 378 * T},
    "H100 NVL": {"bf16": 835 * T, "fp16": 835 * T, "tf32": 418 * T},
    "H100": {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T},
    "H200 NVL": {"bf16": 835 * T, "fp16": 835 * T, "tf32": 418 * T},
    "H200": {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T},
    "H800": {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T},
    "GH200": {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T},
    "B200": {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1100 * T},
    "A100": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T},
    "A800": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T},
    "A10G": {"bf16": 70 * T, "fp16": 70 * T, "tf32": 35 * T},
    "A10": {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T},
    "L40S": {"bf16": 362 * T, "fp16": 362 * T, "tf32": 183 * T},
    "L40": {"bf16": 181 * T, "fp16": 181 * T, "tf32": 90.5 * T},
    "L4": {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T},
    "RTX 4090": {"bf16": 165 * T, "fp16": 165 * T, "tf32": 82.6 * T},
    "V100": {"fp16": 125 * T},
    "T4": {"fp16": 65 * T},
}
PRECISIONS = ("bf16", "fp16", "tf32")


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """The device's dense peak FLOP/s in `precision`, or None when unknown (then no MFU is reported)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    name = device_name.upper()
    for key in sorted(PEAKS, key=len, reverse=True):
        if _names(name, key):
            return PEAKS[key].get(precision)
    return None


def _names(name: str, key: str) -> bool:
    """`key` appears in `name` as whole words: "L4" is not in "L40S", "A10" not in "A100"."""
    at = name.find(key)
    while at >= 0:
        after = name[at + len(key): at + len(key) + 1]
        before = name[at - 1: at] if at else ""
        if not (after.isalnum() or before.isalnum()):
            return True
        at = name.find(key, at + 1)
    return False


def mfu(flops_per_s: float, peak: float, devices: int) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over what `devices` devices of this peak could do."""
    return flops_per_s / (peak * devices)
