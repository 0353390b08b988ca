"""Which workers a waiting gang reserves (rule 4 of policy.py), pure: on a shared worker, only the slots it needs.

The oldest jobs needing more than one worker that have waited reserve_after_s (up to max_reservations, the oldest
first) each reserve the fitting workers expected to have the gang's slots free first, by the timeouts of the jobs
on them, among those no older gang reserved. policy.plan then holds them: a worker of one job at a time whole, a
shared worker (issue 30) only the gang's slots, counted as held once that many are free; its other slots stay
open to any job, and the held ones to the jobs the reservation lets take them (backfill).
"""

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from service.scheduling.pool import CHARGE_CAP_S, PRIORITY_RANK, Node, Reservation, Running, Snapshot, Waiting
from service.workers import fit


def reserve(gangs: Sequence[Waiting], snap: Snapshot, fitting: Callable[[fit.Need], list[Node]],
            open_slots: Mapping[str, int]) -> list[Reservation]:
    """The reservations of `gangs` (those that may reserve: waited long enough, not over a quota), oldest first.

    `open_slots`: each live worker's free slots that no forming gang holds."""
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
        out.append(Reservation(job.id, [n.id for n in chosen],
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
