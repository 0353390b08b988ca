"""What the scheduling policy reads and answers (policy.py): the pool's snapshot, and the plan.

Plain frozen values, no I/O: service/scheduling/service.py builds a Snapshot from the database,
bench/scheduler_sim.py from a simulated month; `policy.plan` turns it into a Plan.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from service.scheduling.placement import Machine
from service.workers import fit

PRIORITY_RANK = {"high": 0, "normal": 1, "low": 2}
CHARGE_CAP_S = 3600.0  # what one placed job charges its owner in the ordering: slots × min(timeout, this)


@dataclass(frozen=True)
class Waiting:
    """A queued job."""

    id: str
    owner: str
    priority: str  # now (aging raises it)
    spec_priority: str  # as submitted: what preemption compares
    submitted: float  # seconds (any epoch, the same as `now`): FIFO within an owner
    queued: float  # when it entered the queue this time: waits are counted from here
    need: fit.Need
    timeout_s: float
    not_before: float | None = None  # a retry's backoff


@dataclass(frozen=True)
class Running:
    """A job holding workers (starting or running)."""

    id: str
    owner: str
    spec_priority: str
    slots: int  # per node
    nodes: int
    started: float  # this attempt
    timeout_s: float
    workers: tuple[str, ...]  # the workers its nodes hold so far (a forming gang holds fewer than `nodes`)
    need: fit.Need | None = None  # a forming gang's: which free workers may join it
    eta_s: float | None = None  # from its progress
    preemptible: bool = True
    preempt_requested: bool = False

    @property
    def forming(self) -> bool:
        return len(self.workers) < self.nodes


@dataclass(frozen=True)
class Node:
    """A live worker (fit.Offer's fields), a job it runs (if any) and its room for more."""

    id: str
    device: str
    slots: int
    memory_bytes: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    running: str | None = None
    # Slots free for another job: a shared worker (issue 30) takes jobs while it has room. None: a worker of one
    # job at a time, all its slots free while it runs nothing, none while it runs something.
    room: int | None = None
    # A shared worker's devices, from its row and the holds table: what a reservation names its devices by.
    machine: Machine | None = None  # its devices and their links (placement.py)
    free_devices: frozenset[int] | None = None  # healthy and held by no job
    held: Mapping[str, frozenset[int]] = field(default_factory=dict)  # job -> the devices it holds here
    images: frozenset[str] = frozenset()  # the images it has unpacked: references and sha256 digests (issue 44)

    @property
    def free_slots(self) -> int:
        if self.room is not None:
            return self.room
        return self.slots if self.running is None else 0

    @cached_property
    def nvlink_island(self) -> int:
        """Its largest NVLink island, as the worker labels itself (fit.NVLINK_ISLAND_LABEL); 0 without one.
        Cached: best fit reads it for every job × worker of a plan."""
        value = str(self.labels.get(fit.NVLINK_ISLAND_LABEL, "0"))
        return int(value) if value.isdigit() else 0


def nvlink_preference(need: int, island: int) -> tuple[bool, bool, int]:
    """How well a job of `need` devices suits a worker whose largest NVLink island is `island`: lower is better.

    Best fit breaks its ties by it (policy.plan; bench/device_sim.py measures it). First the workers whose island
    the job does not break (island <= need: a PCIe machine, a smaller island, or one the job fills), so a 1-, 2-
    or 4-GPU job leaves an NVLink machine whole for the 8-GPU job that needs it, even at some bandwidth of its
    own (a PCIe pair instead of NVLink); then those whose island holds the whole job (2+ devices); then, among
    islands it breaks, the smallest, and among those it does not, the largest (more of the job on NVLink).
    """
    breaks = need < island
    return breaks, not (need >= 2 and island >= need), island if breaks else -island


def island_floor(need: int, nodes: int, islands: Sequence[int]) -> int:
    """The NVLink island a worker must have to take a job of `need` GPUs on `nodes` nodes (0: any), given the
    largest islands of the live workers that otherwise fit it (Settings.nvlink_whole_jobs; bench/device_sim.py).

    A one-node job that fills the largest island among them (2+ GPUs, as many as that island holds: 8 on a fleet
    of DGX and PCIe machines) waits for a worker whose island holds it whole rather than run across PCIe; where
    no live worker that fits has one (a PCIe-only fleet, or a selector that rules them out) it runs where it fits.
    Never held to it, as bench/README.md measures:
    - a job smaller than the largest island: nvlink_preference sends it off NVLink on purpose, so the islands
      stay whole for the jobs that fill them;
    - a gang (nodes > 1): its nodes talk over the network anyway, and with gangs held to NVLink too, the large
      jobs' work (~70% of the GPU-hours in the simulated trace) had only the NVLink half of a mixed fleet: the
      longest large-job wait went from 1.3 d to 20.5 d at load 0.8. It still prefers NVLink (nvlink_preference).
    """
    if nodes > 1 or need < 2 or max(islands, default=0) != need:
        return 0
    return need


def whole_island(need: fit.Need, fits: Sequence[Node]) -> list[Node] | None:
    """The workers of `fits` a CUDA job may take under island_floor; None where the rule does not bind."""
    if need.device != "cuda":
        return None
    floor = island_floor(need.slots, need.nodes, [n.nvlink_island for n in fits])
    return [n for n in fits if n.nvlink_island >= floor] if floor else None


def device_noun(need: fit.Need, node: Node) -> str:
    """What a slot is called in a reason a user reads: a GPU, or on a CPU worker a slot of cores."""
    return "GPUs" if "cuda" in (need.device, node.device) else "CPU slots"


@dataclass(frozen=True)
class Account:
    """A user's standing: team, weight, quota."""

    team: str | None = None
    weight: float = 1.0
    max_slots: int | None = None


@dataclass(frozen=True)
class Team:
    weight: float = 1.0
    max_slots: int | None = None


@dataclass(frozen=True)
class Settings:
    policy: str = "fair"  # fair | fifo
    preempt_after_s: float = 60.0
    min_runtime_s: float = 600.0
    reserve_after_s: float = 300.0
    reserve_deadline_s: float = 48 * 3600.0
    max_reservations: int = 1
    nvlink_whole_jobs: bool = True  # a job that fills an NVLink island waits for one (island_floor)


@dataclass(frozen=True)
class Snapshot:
    now: float
    waiting: Sequence[Waiting]
    running: Sequence[Running]
    nodes: Sequence[Node]
    usage: Mapping[str, float] = field(default_factory=dict)  # owner -> decayed device-seconds, running included
    accounts: Mapping[str, Account] = field(default_factory=dict)
    teams: Mapping[str, Team] = field(default_factory=dict)
    settings: Settings = Settings()


@dataclass
class Place:
    """One waiting job's place in the plan."""

    job_id: str
    owner: str
    position: int  # 1 = next
    reason: str | None  # None: it starts now (workers assigned)
    workers: list[str] = field(default_factory=list)  # assigned: these may take it
    estimated_start: float | None = None  # `now` for those that start now


@dataclass(frozen=True)
class Preemption:
    victim: str
    for_job: str
    detail: str


@dataclass
class Reservation:
    job_id: str
    workers: list[str]
    held: int  # of them, with the gang's slots free now
    fill_at: float  # when the last of them is expected free (by timeouts): backfill must end before
    deadline: float  # a job of higher priority than the gang may take a reserved worker if it ends before
    rank: int  # the gang's priority rank now
    slots: int = 1  # what the gang needs on each: all a shared worker holds for it (its other slots stay open)
    # Shared worker -> the devices it holds for the gang (reservations.py): no other job may take them, unless
    # `lets` it; the gang gets exactly them once free. A worker whose devices the snapshot does not know: absent.
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def lets(self, job: "Waiting", now: float) -> bool:
        """Whether `job` (another one) may take one of these workers while they are reserved."""
        ends = now + job.timeout_s
        return ends <= self.fill_at or (PRIORITY_RANK.get(job.priority, 1) < self.rank and ends <= self.deadline)


@dataclass
class Plan:
    order: list[Place]
    preemptions: list[Preemption]
    reservations: list[Reservation]  # the oldest gang's first
    shares: dict[str, float]  # owner -> usage ÷ weight (the user's; teams' in team_shares)
    team_shares: dict[str, float]
    # Worker -> job -> the devices held for it there (a reservation's, a forming gang's): what the worker's
    # dispatcher keeps other jobs off (worker/dispatch.py).
    kept: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)

    def for_worker(self, worker_id: str) -> list[str]:
        """The jobs this worker may take, in order."""
        return [p.job_id for p in self.order if worker_id in p.workers]

    def place(self, job_id: str) -> Place | None:
        return next((p for p in self.order if p.job_id == job_id), None)
