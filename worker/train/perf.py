"""How fast a rank trains, for the metrics and the summary: throughput, MFU, and the GPU's own view (NVML).

MFU is taken against the peak of the precision the matmuls run in (trainjobs/peaks.py), on CUDA only: a device
the table does not know gets no MFU, never a guess.
"""

from dataclasses import dataclass, field

import torch

from trainjobs.peaks import peak_flops
from worker.usage import GpuReader, job_gpus


@dataclass
class Speed:
    """What one rank knows of its speed: the model's FLOPs per sample and the device's peak."""

    global_batch: int
    tokens_per_sample: int  # 0 for a model that is not a language model
    world_size: int
    sample_flops: float
    device_name: str | None  # CUDA only
    precision: str  # bf16, fp16 or tf32: what the peak is for
    peak: float | None = field(init=False)

    def __post_init__(self):
        self.peak = peak_flops(self.device_name, self.precision) if self.device_name else None

    def figures(self, steps: int, seconds: float) -> dict[str, float]:
        """samples_per_s, step_time_s, tokens_per_s (language models) and mfu (a known CUDA device)."""
        samples_per_s = steps * self.global_batch / seconds
        out = {"samples_per_s": samples_per_s, "step_time_s": seconds / steps}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.peak:
            out["mfu"] = samples_per_s * self.sample_flops / (self.peak * self.world_size)
        return out

    def constants(self) -> dict:
        """For the summary: what the MFU was computed from."""
        out = {"flops_per_step": self.sample_flops * self.global_batch, "precision": self.precision}
        if self.device_name:
            out["device_name"] = self.device_name
        if self.peak:
            out["peak_flops"] = self.peak
        return out


class DeviceUse:
    """This rank's GPU as NVML sees it, read at log steps: utilisation (mean) and memory in use (peak).

    NVML's memory counts what torch's allocator does not (the CUDA context, NCCL's buffers, the cache). Without
    nvidia-ml-py or a driver (and on CPU) it reads nothing, and the summary says nothing: never a made-up value.
    """

    def __init__(self, device: torch.device, local_rank: int):
        self.reader = None
        if device.type == "cuda":
            reader = GpuReader(job_gpus(local_rank + 1)[local_rank:])
            self.reader = reader if reader.source == "nvml" else None  # no nvidia-smi subprocess inside a step loop
        self.utils: list[float] = []
        self.mem_peak = 0

    def sample(self) -> None:
        readings = self.reader.read() if self.reader is not None else None
        if readings:
            self.utils.append(readings[0].util)
            self.mem_peak = max(self.mem_peak, readings[0].mem_bytes)

    def summary(self) -> dict[str, float]:
        if not self.utils:
            return {}
        return {"gpu_util": sum(self.utils) / len(self.utils), "gpu_mem_peak_mb": self.mem_peak / 2**20}

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
