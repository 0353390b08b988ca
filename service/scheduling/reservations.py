"""Which workers a waiting gang reserves (rule 4 of policy.py), pure: on a shared worker, only the slots it needs.

The oldest jobs needing more than one worker that have waited reserve_after_s (up to max_reservations, the oldest
first) each reserve the fitting workers expected to have the gang's slots free first, by the timeouts of the jobs
on them, among those no older gang reserved. policy.plan then holds them: a worker of one job at a time whole, a
shared worker (issue 30) only the gang's slots, counted as held once that many are free; its other slots stay
open to any job, and the held ones to the jobs the reservation lets take them (backfill).

On a shared worker whose devices the snapshot knows (Node.machine, free_devices, held), the reservation names
the devices it holds (Reservation.devices): the best-linked set (placement.choose, as the worker itself picks)
among those free now and those the jobs on it that end first will free, so the gang gets an NVLink island or
one socket rather than whatever backfill leaves; the worker's dispatcher keeps other jobs off them.
"""

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from service.scheduling import placement
from service.scheduling.pool import CHARGE_CAP_S, PRIORITY_RANK, Node, Reservation, Running, Snapshot, Waiting
from service.workers import fit


def reserve(gangs: Sequence[Waiting], snap: Snapshot, fitting: Callable[[fit.Need], list[Node]],
            open_slots: Mapping[str, int], kept: Mapping[str, Mapping[str, tuple[int, ...]]] = {}) \
        -> list[Reservation]:
    """The reservations of `gangs` (those that may reserve: waited long enough, not over a quota), oldest first.

    `open_slots`: each live worker's free slots that no forming gang holds; `kept`: the devices forming gangs
    hold (worker -> job -> devices)."""
    cfg, now = snap.settings, snap.now
    on: dict[str, list[Running]] = defaultdict(list)
    for r in snap.running:
        for w in r.workers:
            on[w].append(r)
    out: list[Reservation] = []
    taken: set[str] = set()
    for job in sorted(gangs, key=lambda j: (j.queued, j.id)):
        if len(out) == cfg.max_reservations:
            break
        slots = job.need.slots
        fits = [n for n in fitting(job.need)
                if n.id not in taken and (open_slots[n.id] > 0 or n.running is not None)]
        if len(fits) < job.need.nodes:
            continue  # cannot be filled (workers lost, too few, or older gangs hold them): none for it yet
        when = {n.id: free_at(n, slots, open_slots[n.id], on[n.id], now) for n in fits}
        fits.sort(key=lambda n: (when[n.id], n.slots, n.id))
        chosen = fits[:job.need.nodes]
        taken.update(n.id for n in chosen)
        devices = {n.id: d for n in chosen
                   if (d := held_devices(n, slots, open_slots[n.id], on[n.id], when[n.id], now,
                                         kept.get(n.id, {}))) is not None}
        out.append(Reservation(job.id, [n.id for n in chosen], devices=devices,
                               held=sum(1 for n in chosen if open_slots[n.id] >= slots),
                               fill_at=max(when[n.id] for n in chosen),
                               deadline=job.queued + cfg.reserve_after_s + cfg.reserve_deadline_s,
                               rank=PRIORITY_RANK.get(job.priority, 1), slots=slots))
    return out


def free_at(node: Node, slots: int, open_now: int, jobs: Sequence[Running], now: float) -> float:
    """When `slots` of the worker are expected free, by the timeouts of the jobs on it (a bound the supervisor
    enforces): a worker of one job at a time once its job ends, a shared one once enough of its jobs have."""
    if open_now >= slots:
        return now
    ends = sorted((max(now, r.started + r.timeout_s), r.slots) for r in jobs)
    if node.room is None:
        return ends[-1][0] if ends else now + CHARGE_CAP_S
    have = open_now
    for end, freed in ends:
        have += freed
        if have >= slots:
            return end
    # Held by something the snapshot does not show (a job being claimed): expected to run a while.
    return now + CHARGE_CAP_S


def held_devices(node: Node, slots: int, open_now: int, jobs: Sequence[Running], when: float, now: float,
                 kept: Mapping[str, tuple[int, ...]] = {}) -> tuple[int, ...] | None:
    """The devices a shared worker holds for a gang of `slots` a node: the best-linked set among those free now
    (less those `kept` for other gangs) and, while too few are, those of the jobs on it that end by `when`
    (free_at's answer); None where the snapshot does not know its devices."""
    if node.room is None or node.machine is None or node.free_devices is None:
        return None
    pool = set(node.free_devices).difference(*kept.values())
    if open_now < slots:
        for r in jobs:
            if max(now, r.started + r.timeout_s) <= when:
                pool |= node.held.get(r.id, frozenset())
    return placement.choose(node.machine, pool, slots)


def held_count(reservation: Reservation, node: Node) -> int:
    """How many of the worker's free slots the reservation holds now: its named devices that are free, else (a
    worker whose devices are not known) the gang's slots, as many as are free."""
    devices = reservation.devices.get(node.id)
    if devices is None or node.free_devices is None:
        return reservation.slots
    return len(node.free_devices.intersection(devices))


def shown(reservation: Reservation, worker: str, noun: str) -> str:
    """What a reason says the reservation holds on `worker`: "GPUs 4-7 on w2", or "4 GPUs on w2"."""
    devices = reservation.devices.get(worker)
    if devices is None:
        return f"{reservation.slots} {noun} on {worker}"
    return f"{noun if len(devices) > 1 else noun[:-1]} {placement.cpulist(devices)} on {worker}"
