"""Whether a worker can run (one node of) a job, and why a queued job waits: pure, over plain values.

A job needs, on every node: the device kind, nproc_per_node slots, the plan's memory per device (on CPU the
ranks share the host, so nproc times it), and every label of resources.selector. A gang (nnodes > 1) needs
that many live workers that fit, one node each.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainjobs.spec import JobSpec

GiB = 2**30
# The labels a worker sets itself (worker/inventory.py), never from TRAINJOBS_WORKER_LABELS.
RESERVED_LABEL_PREFIX = "trainjobs.io/"
PIP_LABEL = "trainjobs.io/pip"  # "true": it builds environments for entrypoint.requirements (TRAINJOBS_ALLOW_PIP)
ENTRYPOINTS_LABEL = "trainjobs.io/entrypoints"  # "true": it runs users' own code (TRAINJOBS_ALLOW_ENTRYPOINTS)
# The size of the machine's largest set of GPUs all NVLink-connected to each other ("0" without NVLink; absent on
# CPU): what best fit breaks its ties by (pool.nvlink_preference).
NVLINK_ISLAND_LABEL = "trainjobs.io/nvlink-island"


class Offer(Protocol):
    id: str
    device: str
    slots: int
    memory_bytes: int | None
    labels: dict[str, Any]


@dataclass(frozen=True)
class Need:
    device: str  # cpu | cuda | auto
    slots: int
    memory_bytes: int | None  # on one device of a worker of the plan's device kind
    memory_device: str | None  # the device kind the plan was made for
    labels: dict[str, str] = field(default_factory=dict)
    nodes: int = 1
    pip: bool = False  # it asks for entrypoint.requirements
    entrypoint: bool = False  # it runs the user's own code
    image: str | None = None  # its container image: a worker that has it unpacked is preferred (issue 44)


def need_of(spec: JobSpec, plan: dict[str, Any] | None) -> Need:
    """What one node of the job needs, from its spec and stored memory plan."""
    res = spec.resources
    estimate = (plan or {}).get(spec.strategy, {}).get("total_bytes") if plan else None
    memory_device = (plan or {}).get("device")
    if estimate is not None and memory_device == "cpu":
        estimate *= res.nproc_per_node  # the plan is per rank; on a CPU host the ranks share one memory
    return Need(device=res.device, slots=res.nproc_per_node, memory_bytes=estimate, memory_device=memory_device,
                labels=dict(res.selector), nodes=res.nnodes,
                pip=bool(spec.entrypoint is not None and spec.entrypoint.requirements),
                entrypoint=spec.entrypoint is not None, image=spec.image)


def misfit(need: Need, worker: Offer) -> str | None:
    """Why `worker` cannot run one node of the job; None when it can."""
    if need.device != "auto" and worker.device != need.device:
        return f"device {worker.device}, needs {need.device}"
    if worker.slots < need.slots:
        return f"{worker.slots} slot(s), needs {need.slots}"
    if (need.memory_bytes is not None and worker.memory_bytes is not None and worker.device == need.memory_device
            and worker.memory_bytes < need.memory_bytes):
        return f"{worker.memory_bytes / GiB:.1f} GiB per device, needs {need.memory_bytes / GiB:.1f} GiB"
    labels = worker.labels or {}
    if need.entrypoint and labels.get(ENTRYPOINTS_LABEL) != "true":
        return "does not run users' own code (TRAINJOBS_ALLOW_ENTRYPOINTS)"
    if need.pip and labels.get(PIP_LABEL) != "true":
        return "does not install requirements (TRAINJOBS_ALLOW_PIP)"
    missing = {k: v for k, v in need.labels.items() if str(labels.get(k)) != v}
    if missing:
        return "lacks label(s) " + ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))
    return None


def fitting(need: Need, workers: Sequence[Offer]) -> list[Offer]:
    return [w for w in workers if misfit(need, w) is None]


def pending_reason(need: Need, live: Sequence[Offer], *, busy: set[str] = frozenset()) -> str | None:
    """Why a queued job waits, in words; None when workers that fit are free (it is about to run)."""
    if not live:
        return "no live worker"
    fit = fitting(need, live)
    if len(fit) < need.nodes:
        misses = "; ".join(f"{w.id}: {m}" for w in live if (m := misfit(need, w)))[:400]
        if need.nodes == 1:
            return f"no live worker fits ({misses})"
        # Every live worker may fit, the pool being too small: then say how many more are needed, not "()".
        why = misses or f"{need.nodes - len(fit)} more needed: one node per worker"
        return f"needs {need.nodes} nodes that fit, {len(fit)} live worker(s) do ({why})"
    free = [w for w in fit if w.id not in busy]
    if len(free) < need.nodes:
        return f"waiting for a free worker: {len(fit)} fit, {len(fit) - len(free)} busy"
    return None
