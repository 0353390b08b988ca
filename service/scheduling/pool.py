"""What the scheduling policy reads and answers (policy.py): the pool's snapshot, and the plan.

Plain frozen values, no I/O: service/scheduling/service.py builds a Snapshot from the database,
bench/scheduler_sim.py from a simulated month; `policy.plan` turns it into a Plan.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

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

    def for_worker(self, worker_id: str) -> list[str]:
        """The jobs this worker may take, in order."""
        return [p.job_id for p in self.order if worker_id in p.workers]

    def place(self, job_id: str) -> Place | None:
        return next((p for p in self.order if p.job_id == job_id), None)
