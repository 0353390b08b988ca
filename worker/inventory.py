"""What this machine offers jobs (device, slots, memory, labels), registered in the workers table and kept fresh."""

import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE
from service.scheduling.placement import Device, Machine, nvlink_island
from service.settings import Settings
from service.workers import fit
from worker import devices
from worker.control import Control, DatabaseControl, Revoked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offer:
    """One worker as a job sees it."""

    id: str  # the worker's name
    host: str
    address: str
    device: str
    slots: int
    memory_bytes: int | None  # per device: the smallest GPU's, or on CPU the host's
    host_memory_bytes: int
    labels: dict[str, str] = field(default_factory=dict)
    max_jobs: int = 1  # jobs it runs at once, each on devices of its own (its lanes, worker/main.py)
    machine: Machine | None = field(default=None, repr=False)  # its devices, as placement sees them


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


def parse_labels(text: str | list[str] | None) -> dict[str, str]:
    """`k=v,k2=v2` (or a list of `k=v`) to a dict; a label without `=` is refused."""
    items = text if isinstance(text, list) else (text or "").split(",")
    labels = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"a worker label is key=value, not {item!r}")
        if key.strip().startswith(fit.RESERVED_LABEL_PREFIX):
            raise ValueError(f"worker labels under {fit.RESERVED_LABEL_PREFIX} are the worker's own, not {item!r}")
        labels[key.strip()] = value.strip()
    return labels


def reachable_address(redis_url: str) -> str:
    """The local address of the route to Redis: the one other machines of the same cluster can reach."""
    url = urlparse(redis_url)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((url.hostname or "127.0.0.1", url.port or 6379))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe(settings: Settings, *, name: str, labels: dict[str, str] | None = None) -> Offer:
    """Detect, then apply what the settings (or `trainjobs worker` flags) override."""
    count, gpu_bytes = gpu_memory()
    host_bytes = psutil.virtual_memory().total  # /proc/meminfo's MemTotal on Linux
    device = settings.worker_device or ("cuda" if count else "cpu")
    detected_slots = count if device == "cuda" else (os.cpu_count() or 1)
    slots = settings.worker_slots or max(1, detected_slots)
    address = settings.worker_address or reachable_address(settings.redis_url)
    machine = inventory(name, device, slots)
    return Offer(id=name, host=socket.gethostname(), address=address,
                 device=device, slots=slots,
                 memory_bytes=gpu_bytes if device == "cuda" else host_bytes, host_memory_bytes=host_bytes,
                 labels={**parse_labels(settings.worker_labels), **(labels or {}), **capabilities(settings),
                         **topology_labels(machine)},
                 max_jobs=min(slots, settings.worker_max_jobs or slots), machine=machine)


def inventory(name: str, device: str, slots: int) -> Machine:
    """The machine's devices: its GPUs (worker/devices.py), or its cores in `slots` slots. A worker told it has
    GPUs that nvidia-smi does not list (a test's, a container's without the tool) numbers them 0..slots-1."""
    if device == "cuda":
        machine = devices.gpu_machine(name, slots)
        if machine is not None and len(machine.devices) >= slots:
            return machine
        return Machine(name, "cuda", tuple(Device(i, str(i)) for i in range(slots)))
    return devices.cpu_machine(name, slots)


def capabilities(settings: Settings) -> dict[str, str]:
    """What the worker's switches let it do, as labels a job's needs match (service/workers/fit.py)."""
    labels = {fit.ENTRYPOINTS_LABEL: "true"} if settings.allow_entrypoints else {}
    return {**labels, fit.PIP_LABEL: "true"} if settings.allow_pip and settings.allow_entrypoints else labels


def topology_labels(machine: Machine) -> dict[str, str]:
    """What the scheduler, which sees labels and not links, must know of the GPUs' topology: the largest NVLink
    island (fit.NVLINK_ISLAND_LABEL, "0" without NVLink), so best fit keeps small jobs off the NVLink machines
    that 8-GPU jobs need. None on CPU."""
    return {fit.NVLINK_ISLAND_LABEL: str(nvlink_island(machine))} if machine.kind == "cuda" else {}


class DiskWatch:
    """Disk pressure: the storage or the run dir (and the data dir) below worker_min_free_bytes of free space.

    Under pressure the worker takes no job (its dequeue waits, worker/dispatch.py) and says why in its row
    (`pressure`, shown by /v1/workers and left out of the scheduler's plan, like a draining worker), until space is
    back. As a Kubernetes node with DiskPressure, or a Slurm node drained for a full /tmp: a job it took would
    fail on the full disk, and its retry be wasted there too.
    """

    CHECK_S = 1.0  # statvfs at most this often

    def __init__(self, settings: Settings):
        self.min_free = settings.worker_min_free_bytes
        self.dirs = [settings.resolved_storage_dir, settings.runs_dir.resolve(), settings.data_dir.resolve()]
        self._checked, self._why = -float("inf"), None
        self._lock = threading.Lock()

    def pressure(self) -> str | None:
        """Why the worker must take no job now (a sentence naming the dir and its free space), or None."""
        with self._lock:
            if time.monotonic() - self._checked < self.CHECK_S:
                return self._why
            why = None
            for folder in self.dirs:
                free = free_bytes(folder)
                if free is not None and free < self.min_free:
                    why = (f"disk pressure: {folder} has {free / 2**20:.0f} MiB free, below "
                           f"TRAINJOBS_WORKER_MIN_FREE_BYTES={self.min_free}; taking no jobs until space is back")
                    break
            if why != self._why:
                if why:
                    log.warning("%s", why)
                else:
                    log.info("disk pressure over: taking jobs again")
            self._checked, self._why = time.monotonic(), why
            return why


def free_bytes(folder: Path) -> int | None:
    """Free space (for an unprivileged writer) on the filesystem of `folder`, or of its nearest existing parent."""
    for path in (folder, *folder.parents):
        try:
            return shutil.disk_usage(path).free
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


class GpuHealth:
    """A GPU worker's devices' health, re-read at most every devices.HEALTH_EVERY_S (worker/devices.py)."""

    def __init__(self, machine: Machine | None):
        self.machine = machine if machine is not None and machine.kind == "cuda" else None
        self.pending: list[dict] | None = None  # rows changed and not yet stored (a beat failed): sent again
        self._checked = time.monotonic()

    def changed(self) -> Machine | None:
        """The machine with its GPUs' health as now, when it changed since the last read; else None."""
        if self.machine is None or time.monotonic() - self._checked < devices.HEALTH_EVERY_S:
            return None
        self._checked = time.monotonic()
        health = devices.gpu_health([d.uuid for d in self.machine.devices if devices.is_gpu_uuid(d.uuid)])
        if health is None:
            return None
        machine = devices.with_health(self.machine, health)
        if machine == self.machine:
            return None
        for before, now in zip(self.machine.devices, machine.devices, strict=True):
            if before.healthy != now.healthy:
                log.warning("GPU %d (%s) is %s", now.index, now.uuid,
                            f"unhealthy: {now.reason}" if not now.healthy else "healthy again")
        self.machine = machine
        return machine


def inventory_of(offer: Offer) -> dict:
    """What a worker registers: its row (service/workers/service.py register; the API's /v1/worker/register)."""
    return {"worker_id": offer.id, "host": offer.host, "address": offer.address, "device": offer.device,
            "slots": offer.slots, "memory_bytes": offer.memory_bytes, "host_memory_bytes": offer.host_memory_bytes,
            "labels": offer.labels, "max_jobs": offer.max_jobs,
            "devices": devices.as_rows(offer.machine) if offer.machine else None}


def start_heartbeat(control: Control | sessionmaker[Session], *, offer: Offer, every_s: float,
                    draining: Callable[[], bool], pressure: Callable[[], str | None] = lambda: None,
                    on_revoked: Callable[[str], None] | None = None,
                    images: Callable[[], list[str]] = list) -> Callable[[], None]:
    """Register now, renew last_seen every every_s from a daemon thread; returns the stop function (deregisters).
    `control`: the database (a sessionmaker) or the API (worker/control.py); a credential the API refuses calls
    on_revoked (the worker then hands its jobs back and stops). `images`: the images it has unpacked, sent when
    they changed (the scheduler's pass prefers this worker for a job naming one).

    On GPUs each beat (at most every devices.HEALTH_EVERY_S) re-reads their health, and stores their rows when it
    changed: /v1/workers then shows the GPU `unhealthy`, with why, and placement leaves it out."""
    if isinstance(control, sessionmaker):
        control = DatabaseControl(control)
    control.register(inventory_of(offer))
    name = offer.id
    stopped = threading.Event()
    health = GpuHealth(offer.machine)

    sent_images: list[str] | None = None

    def loop() -> None:
        nonlocal offer, sent_images
        while not stopped.wait(every_s):
            try:
                if (machine := health.changed()) is not None:
                    offer = dataclasses.replace(offer, machine=machine)
                    health.pending = devices.as_rows(machine)
                now_images = images()
                found = control.beat(worker_id=name, draining=draining(), pressure=pressure(), devices=health.pending,
                                     images=None if now_images == sent_images else now_images)
                health.pending, sent_images = None, now_images
                if not found:  # pruned while we were cut off: come back (and say again what it has)
                    control.register(inventory_of(offer))
                    sent_images = None
            except Revoked as exc:
                log.error("worker %s: the API refused this machine's credential (%s): handing its jobs back and "
                          "stopping", name, exc)
                if on_revoked is not None:
                    on_revoked(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a database or API blip: the next beat tries again
                outage = isinstance(exc, (*UNREACHABLE, httpx.TransportError))  # known: no traceback every beat
                log.warning("worker heartbeat failed (%s); retrying in %.1fs", type(exc).__name__, every_s,
                            exc_info=not outage)

    def stop() -> None:
        stopped.set()
        thread.join(timeout=5)
        try:
            control.remove(name)
        except Revoked:  # its credential revoked: the API marked its row draining; it shows lost, then is pruned
            log.info("worker %s leaves its row to be pruned (its credential was revoked)", name)
        except Exception:  # noqa: BLE001 - the row then shows as lost, and is pruned later
            log.warning("could not remove worker %s from the workers table", name, exc_info=True)

    thread = threading.Thread(target=loop, name="worker-heartbeat", daemon=True)
    thread.start()
    log.info("worker %s offers %s", name, offer)
    return stop
