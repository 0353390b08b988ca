"""This machine's devices as placement sees them (service/scheduling/placement.py): GPUs with their UUIDs and
links, or on a CPU machine its cores in slots; and what one job's share of them means for its processes.

A CUDA worker asks nvidia-smi for each GPU's index, UUID and memory, and `nvidia-smi topo -m` for the links and
each GPU's NUMA node; a GPU whose query answers an error is unhealthy (placement leaves it out and names it).
A CPU worker splits the cores it may use (its affinity) into its slots, never across a NUMA node.

A GPU can turn bad under a running job (an NVML error, an Xid, fallen off the bus): gpu_health re-reads them. The
worker's heartbeat reports it (worker/inventory.py: the device's state `unhealthy` in /v1/workers, and placement
leaves it out), and the attempt holding it is stopped and retried elsewhere (HealthWatch, worker/supervisor.py).
"""

import dataclasses
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from service.scheduling import placement
from service.scheduling.placement import Device, Machine

log = logging.getLogger(__name__)
NODES = Path("/sys/devices/system/node")
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
QUERY = ("--query-gpu=index,uuid,memory.total,pci.bus_id", "--format=csv,noheader,nounits")
HEALTH_EVERY_S = 5.0  # how often a worker and each attempt on GPUs re-read their GPUs' health
HEALTH_TIMEOUT_S = 10.0


def numa_nodes() -> dict[int, tuple[int, ...]]:
    """NUMA node -> its cores, from sysfs ({} where it says nothing)."""
    out = {}
    for node in sorted(NODES.glob("node[0-9]*")):
        try:
            cores = placement.parse_cpulist((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cores:
            out[int(node.name[4:])] = cores
    return out


def cpu_machine(name: str, slots: int) -> Machine:
    """The cores this worker may use in `slots` slots. More slots than cores (a worker told to offer them) share
    cores round robin: then slots are a count of processes, not a bound on cores, as before sharing."""
    cores = sorted(os.sched_getaffinity(0))
    if slots <= len(cores):
        numa = {n: tuple(c for c in cs if c in cores) for n, cs in numa_nodes().items()}
        return placement.cpu_machine(name, cores, {n: cs for n, cs in numa.items() if cs}, slots)
    devices = tuple(Device(i, f"cpu-slot-{i}", cores=(cores[i % len(cores)],)) for i in range(slots))
    return Machine(name, "cpu", devices, {}, {})


def gpu_machine(name: str, slots: int | None = None) -> Machine | None:
    """The GPUs nvidia-smi lists (the first `slots` of them when fewer are offered), or None without any."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        log.warning("nvidia-smi failed: no GPU inventory", exc_info=True)
        return None
    devices = visible(parse_gpus(out), os.environ.get("CUDA_VISIBLE_DEVICES"))
    devices = devices[:slots] if slots else devices
    if not devices:
        return None
    try:
        topo = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10, check=True).stdout
        return placement.machine_from_topo(name, topo, devices)
    except (OSError, subprocess.SubprocessError, ValueError):
        log.warning("nvidia-smi topo -m failed: placing GPUs without their links", exc_info=True)
        return Machine(name, "cuda", tuple(devices))


def parse_gpus(out: str) -> list[Device]:
    """The GPUs of nvidia-smi's QUERY answer; one whose row answers an error ([N/A], [Unknown Error]) unhealthy."""
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        index, uuid, memory = int(parts[0]), parts[1], parts[2]
        healthy = memory.replace(".", "", 1).isdigit() and uuid.startswith("GPU-")
        devices.append(Device(index, uuid, int(float(memory)) * 2**20 if healthy else None, healthy=healthy,
                              reason=None if healthy else f"nvidia-smi reports {memory!r}"))
    return devices


def gpu_health(uuids: list[str]) -> dict[str, str | None] | None:
    """Each of these GPUs' health as nvidia-smi answers now: None (healthy) or why not (an error in its row, or gone
    from the list: fallen off the bus, with what nvidia-smi said); None when nvidia-smi cannot be asked at all (no
    verdict: a slow or missing tool is no reason to stop anyone's job)."""
    exe = shutil.which("nvidia-smi")
    if exe is None or not uuids:
        return None
    try:
        done = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=HEALTH_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi could not be asked for GPU health (%s): no verdict this time", exc)
        return None
    listed = {d.uuid: d for d in parse_gpus(done.stdout)}
    said = "; ".join(line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines()
                     if line.strip() and not any(line.strip().startswith(f"{d.index},") for d in listed.values()))
    health: dict[str, str | None] = {}
    for uuid in uuids:
        device = listed.get(uuid)
        if device is None:
            health[uuid] = "nvidia-smi no longer lists it (fallen off the bus?)" + (f": {said[:300]}" if said else "")
        else:
            health[uuid] = None if device.healthy else device.reason
    return health


def is_gpu_uuid(uuid: str) -> bool:
    """A UUID nvidia-smi gave (not a number standing in for a GPU it does not list: a test's, a container's)."""
    return uuid.startswith("GPU-")


def with_health(machine: Machine, health: dict[str, str | None]) -> Machine:
    """`machine` with its GPUs' health as `health` says (uuid -> None or why not); a GPU it does not name is kept
    as it was."""
    devices = tuple(dataclasses.replace(d, healthy=health[d.uuid] is None, reason=health[d.uuid])
                    if d.uuid in health else d for d in machine.devices)
    return dataclasses.replace(machine, devices=devices)


def reported_health(rows: list[dict]) -> dict[str, str | None]:
    """The health a worker's heartbeat last stored (its devices' rows, as_rows), as with_health takes it."""
    return {r["uuid"]: None if r.get("healthy", True) else (r.get("reason") or "unhealthy") for r in rows}


class HealthWatch:
    """The health of one attempt's GPUs, re-read at most every `every_s`: the first to turn bad, named."""

    def __init__(self, gpus: list[tuple[int, str]], every_s: float = HEALTH_EVERY_S):
        self.gpus, self.every_s = gpus, every_s  # (index, UUID) of each
        self._checked, self.problem = time.monotonic(), None

    def poll(self) -> str | None:
        """Why the attempt's GPUs can no longer be trusted ("GPU 3 (GPU-…) turned unhealthy: …"), or None."""
        if not self.gpus or self.problem is not None or time.monotonic() - self._checked < self.every_s:
            return self.problem
        self._checked = time.monotonic()
        health = gpu_health([uuid for _, uuid in self.gpus]) or {}
        for index, uuid in self.gpus:
            if reason := health.get(uuid):
                self.problem = f"GPU {index} ({uuid}) turned unhealthy: {reason}"
                log.error("%s", self.problem)
                break
        return self.problem


def visible(devices: list[Device], mask: str | None) -> list[Device]:
    """The GPUs a worker started under CUDA_VISIBLE_DEVICES (indices or UUIDs, as CUDA reads it) may give jobs:
    a worker per group of GPUs on one machine offers only its group. Unset: every GPU."""
    if mask is None:
        return devices
    wanted = [w.strip() for w in mask.split(",") if w.strip()]
    by_key = {**{str(d.index): d for d in devices}, **{d.uuid: d for d in devices}}
    out = []
    for w in wanted:
        d = by_key.get(w) or next((d for d in devices if d.uuid.startswith(w)), None)  # CUDA takes UUID prefixes
        if d is None:
            break  # CUDA stops at the first entry it cannot resolve
        if d not in out:
            out.append(d)
    return out


def as_rows(machine: Machine) -> list[dict]:
    """The inventory as the workers table keeps it (and /v1/workers shows it). A GPU's row names its links to the
    others (index -> "NV12", "PIX", ...), so the scheduler picks the devices a reservation holds as this worker
    would (service/scheduling/service.py machine_of); CPU slots' links follow from their NUMA nodes."""
    def links(d: Device) -> dict[str, str]:
        if machine.kind != "cuda":
            return {}
        return {str(e.index): str(machine.link(d.index, e.index)) for e in machine.devices if e.index != d.index
                and ((d.index, e.index) in machine.links or (e.index, d.index) in machine.links)}

    return [{"index": d.index, "uuid": d.uuid, "memory_bytes": d.memory_bytes, "healthy": d.healthy,
             "numa_node": d.numa_node, "cores": list(d.cores), "reason": d.reason,
             **({"links": found} if (found := links(d)) else {})} for d in machine.devices]


def share(machine: Machine, devices: list[int]) -> dict:
    """One node's share, as stored with its attempt and handed to its launch: the devices, the GPUs' UUIDs and
    CUDA_VISIBLE_DEVICES, the cores its ranks are pinned to."""
    return {"devices": list(devices), "kind": machine.kind,
            "uuids": [machine.device(i).uuid for i in devices] if machine.kind == "cuda" else [],
            "visible": placement.visible_devices(machine, devices),
            "cores": placement.cpu_affinity(machine, devices)}


def gpu_device_nodes(uuids: list[str]) -> list[str] | None:
    """/dev/nvidiaN of these GPUs (the driver's minor numbers, by PCI bus id), or None when they cannot be told
    apart (the job then gets every GPU node, and CUDA_VISIBLE_DEVICES alone narrows what CUDA shows it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None or not NVIDIA_PROC.is_dir():
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        bus_of = {u.strip(): b.strip().lower() for u, _, b in (line.partition(",") for line in out.splitlines())}
        minors = {}
        for folder in NVIDIA_PROC.iterdir():
            for line in (folder / "information").read_text().splitlines():
                if line.startswith("Device Minor:"):
                    minors[folder.name.lower()] = int(line.split(":")[1])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    nodes = []
    for uuid in uuids:
        bus = bus_of.get(uuid, "")
        minor = next((m for b, m in minors.items() if b.endswith(bus[-12:]) or bus.endswith(b[-12:])), None)
        if minor is None:
            return None
        nodes.append(f"/dev/nvidia{minor}")
    return nodes
