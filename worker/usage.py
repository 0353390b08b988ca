"""What an attempt uses of this machine, sampled from outside its ranks by the supervisor: on CUDA each of the
job's GPUs (utilisation and memory; NVML through nvidia-ml-py, else `nvidia-smi`), on CPU each rank's CPU use
(psutil: the rank and its own children, such as data loader workers). Nothing here is needed on a CPU worker:
without NVML or nvidia-smi the GPU side reads nothing.
"""

import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)
SMI_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Gpu:
    util: float  # percent of the sample period a kernel ran (NVML's utilization.gpu)
    mem_bytes: int  # memory used on the device, by any process


def job_gpus(nproc: int, visible: str | None = None) -> list[str]:
    """The devices the job's local ranks use (cuda:<local rank>), as NVML or nvidia-smi name them.

    A rank's cuda:i is the i-th of the worker's CUDA_VISIBLE_DEVICES (indices or UUIDs), else GPU i.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None or not visible.strip():
        return [str(i) for i in range(nproc)]
    return [part.strip() for part in visible.split(",") if part.strip()][:nproc]


class GpuReader:
    """Reads the job's GPUs: NVML when nvidia-ml-py and the driver's library load, else nvidia-smi, else nothing."""

    def __init__(self, devices: list[str]):
        self.devices = devices
        self._nvml, self._handles, self._smi = None, [], None
        try:
            import pynvml  # nvidia-ml-py: optional (the `worker` extra), a thin ctypes binding to the driver

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(int(d)) if d.isdigit()
                             else pynvml.nvmlDeviceGetHandleByUUID(d) for d in devices]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - not installed, no driver, no such device: try nvidia-smi
            self._smi = shutil.which("nvidia-smi")
        self.source = "nvml" if self._nvml else "nvidia-smi" if self._smi else None

    def read(self) -> list[Gpu] | None:
        """One reading per device, in the job's order; None when nothing could be read."""
        try:
            if self._nvml is not None:
                return [Gpu(float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                            int(self._nvml.nvmlDeviceGetMemoryInfo(h).used)) for h in self._handles]
            if self._smi is not None:
                return self._read_smi()
        except Exception:  # noqa: BLE001 - a GPU that stopped answering must not stop the supervisor
            log.warning("reading the GPUs (%s) failed", self.source, exc_info=True)
        return None

    def _read_smi(self) -> list[Gpu] | None:
        out = subprocess.run([self._smi, "--query-gpu=index,uuid,utilization.gpu,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=SMI_TIMEOUT_S, check=True).stdout
        found = {}
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 4 and parts[2].replace(".", "", 1).isdigit():
                gpu = Gpu(float(parts[2]), int(float(parts[3]) * 2**20) if parts[3].replace(".", "", 1).isdigit()
                          else 0)
                found[parts[0]], found[parts[1]] = gpu, gpu
        readings = [found.get(d) for d in self.devices]
        return None if any(r is None for r in readings) else readings  # type: ignore[return-value]

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a library that stopped answering
                pass


class RankCpu:
    """Each rank's CPU use since the last call, in percent of one core (200 = two cores busy)."""

    def __init__(self):
        self._ranks: dict[int, tuple[psutil.Process, int | None]] = {}  # pid -> (process, global rank)
        self._last: dict[int, tuple[float, float]] = {}  # rank -> (cpu seconds of its tree, when)

    def read(self, torchrun_pid: int) -> dict[int, float]:
        try:
            children = psutil.Process(torchrun_pid).children()
        except psutil.Error:
            return {}
        now, found = time.monotonic(), {}
        for child in children:
            if child.pid not in self._ranks:
                self._ranks[child.pid] = (child, _rank_of(child))
            proc, rank = self._ranks[child.pid]
            if rank is None:
                continue
            seconds = _cpu_seconds(proc)
            if seconds is None:
                continue
            last = self._last.get(rank)
            self._last[rank] = (seconds, now)
            if last is not None and now > last[1]:
                found[rank] = max(0.0, 100 * (seconds - last[0]) / (now - last[1]))
        return dict(sorted(found.items()))


def _rank_of(proc: psutil.Process) -> int | None:
    try:
        rank = proc.environ().get("RANK")
    except psutil.Error:
        return None
    return int(rank) if rank and rank.isdigit() else None


def _cpu_seconds(proc: psutil.Process) -> float | None:
    """User and system time of the process and its descendants, live or reaped (a DataLoader's workers are its
    work too)."""
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for p in tree:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system  # children_*: the ones it reaped
    return total
