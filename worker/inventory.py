"""What this machine offers jobs (GPU and host memory), kept fresh in Redis for the control plane's planner."""

import logging
import shutil
import subprocess
import threading
from collections.abc import Callable

import psutil
from redis import Redis
from redis.exceptions import RedisError

from service.workers_registry import REFRESH_S, WorkerMemory, publish, worker_key

log = logging.getLogger(__name__)


def gpu_memory() -> tuple[int, int | None]:
    """(number of GPUs, the smallest one's memory in bytes) from nvidia-smi; (0, None) without a usable one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        log.warning("nvidia-smi failed: reporting no GPU", exc_info=True)
        return 0, None
    mib = [int(float(line)) for line in out.split() if line.replace(".", "", 1).isdigit()]  # MiB per GPU
    return (len(mib), min(mib) * 2**20) if mib else (0, None)


def probe() -> WorkerMemory:
    count, gpu_bytes = gpu_memory()
    # psutil reads /proc/meminfo on Linux (MemTotal) and works elsewhere too.
    return WorkerMemory(device="cuda" if count else "cpu", gpu_count=count, gpu_memory_bytes=gpu_bytes,
                        host_memory_bytes=psutil.virtual_memory().total)


def start_publisher(redis: Redis, *, prefix: str, name: str, every_s: float = REFRESH_S) -> Callable[[], None]:
    """Publish this worker's memory now and every every_s from a daemon thread; returns the stop function."""
    memory, stopped = probe(), threading.Event()

    def loop() -> None:
        while True:
            try:
                publish(redis, prefix=prefix, name=name, memory=memory)
            except RedisError:
                log.warning("could not publish this worker's memory; retrying in %.0fs", every_s)
            if stopped.wait(every_s):
                return

    def stop() -> None:
        stopped.set()
        thread.join(timeout=5)
        try:
            redis.delete(worker_key(prefix, name))
        except RedisError:
            pass  # the key expires on its own

    thread = threading.Thread(target=loop, name="memory-publisher", daemon=True)
    thread.start()
    log.info("worker %s offers %s", name, memory.model_dump_json())
    return stop
