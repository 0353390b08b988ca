"""Whom a waiting `high` job preempts (rule 5 of policy.py), pure: it counts devices, not workers (issue 30).

A job submitted `high` that has waited preempt_after_s, that no free worker fits and that is not over a quota,
preempts running jobs of strictly lower spec priority that are preemptible and have run min_runtime_s. It frees
only what it needs, one machine for each node it lacks: on a machine, victims are taken most over their owner's
share first, then lowest priority, then latest started (the least work since its last checkpoint is lost), until
the node's slots are free, and one the others free enough without is dropped again. Among machines the one that
frees the fewest devices beyond the need wins (a 1-GPU job stops a 1-GPU job, not an 8-GPU one), then the fewest
victims, then the most of its nodes freed at once (one gang rather than two singles), then the victims first in
that order. A node is one machine, so a one-node job never has victims on two. The machines a job may take are
those `fitting` gives: for one that fills an NVLink island, only those with one (pool.island_floor).

What is free now, and what victims already asked to stop give back, is promised in the plan's order to one
waiting job and not counted again for the next. A shared worker reserved for another gang keeps the gang's slots
(a worker of one job at a time is kept whole) unless the reservation lets this job take them.
"""

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from service.scheduling.pool import (
    PRIORITY_RANK,
    Account,
    Node,
    Place,
    Preemption,
    Reservation,
    Running,
    Snapshot,
    Waiting,
    device_noun,
)
from service.workers import fit

Fitting = Callable[[fit.Need], list[Node]]


@dataclass(frozen=True)
class _Option:
    """Victims that free one machine for a node of the waiting job."""

    victims: list[Running]
    machines: list[str]  # the machines they ready for its nodes, the one they were chosen on first
    rank: tuple  # the smallest wins


def preempt(ordered: Sequence[Waiting], places: Mapping[str, Place], snap: Snapshot, fitting: Fitting,
            reserved: Mapping[str, Reservation]) -> tuple[list[Preemption], dict[str, str]]:
    """The preemptions the plan asks for; and, for each job that preempts or waits on victims leaving, a note in
    device terms for its pending reason."""
    cfg, now = snap.settings, snap.now
    nodes = {n.id: n for n in snap.nodes}
    promised: dict[str, int] = defaultdict(int)  # slots counted as coming for a job earlier in the order
    gone = [r for r in snap.running if r.preempt_requested]  # on their way out: they free their slots for someone
    taken = {r.id for r in gone}
    share = {o: snap.usage.get(o, 0.0) / max(snap.accounts.get(o, Account()).weight, 1e-9)
             for o in {r.owner for r in snap.running}}

    def first(r: Running) -> tuple:  # the order victims are taken in on one machine
        return -share[r.owner], -PRIORITY_RANK.get(r.spec_priority, 1), -r.started, r.id

    candidates = sorted((r for r in snap.running if r.id not in taken and r.preemptible and not r.forming
                         and now - r.started >= cfg.min_runtime_s), key=first)
    out: list[Preemption] = []
    notes: dict[str, str] = {}
    for job in ordered:
        if not _may_preempt(job, places[job.id], snap):
            continue
        fits, budget = _machines(job, fitting, reserved, nodes, now)
        if len(fits) < job.need.nodes:
            continue
        avail = {w: nodes[w].free_slots for w in fits}
        for v in gone:
            _give_back(v, avail, nodes)
        for w in fits:
            budget[w] = budget.get(w, 0) + promised[w]
        rank = PRIORITY_RANK[job.spec_priority]
        victims = [r for r in candidates if r.id not in taken and PRIORITY_RANK.get(r.spec_priority, 1) > rank]
        found = _choose(job.need, avail, budget, victims, nodes, first)
        if found is None:
            continue  # preempting every candidate would still not free its nodes: preempt nobody
        chosen, machines = found
        for w in machines:
            promised[w] += job.need.slots if nodes[w].room is not None else nodes[w].slots
        for r in chosen:
            taken.add(r.id)
            gone.append(r)
            out.append(Preemption(r.id, job.id, f"preempted by job {job.id} (priority {job.spec_priority}, "
                                                f"owner {job.owner}), which waited {now - job.queued:.0f}s"))
        if (note := _note(job.need, chosen, machines, nodes)) is not None:
            notes[job.id] = note
    return out, notes


def _may_preempt(job: Waiting, place: Place, snap: Snapshot) -> bool:
    """A `high` job as submitted (aging does not count), unplaced, waited long enough, not in backoff or over quota."""
    now = snap.now
    return not (place.workers or job.spec_priority != "high" or now - job.queued < snap.settings.preempt_after_s
                or (job.not_before is not None and job.not_before > now) or (place.reason or "").startswith("over "))


def _machines(job: Waiting, fitting: Fitting, reserved: Mapping[str, Reservation], nodes: Mapping[str, Node],
              now: float) -> tuple[list[str], dict[str, int]]:
    """The machines the job could take once free, and the slots of each that another gang's reservation keeps."""
    fits: list[str] = []
    kept: dict[str, int] = {}
    for n in fitting(job.need):
        holder = reserved.get(n.id)
        if holder is not None and holder.job_id != job.id and not holder.lets(job, now):
            if n.room is None:
                continue  # a worker of one job at a time is kept whole for the gang
            kept[n.id] = holder.slots
        fits.append(n.id)
    return fits, kept


def _frees(victim: Running, worker: str, nodes: Mapping[str, Node]) -> int:
    """The slots a victim gives back on a worker: its own on a shared one, all of a worker of one job at a time."""
    node = nodes.get(worker)
    return node.slots if node is not None and node.room is None else victim.slots


def _give_back(victim: Running, avail: dict[str, int], nodes: Mapping[str, Node]) -> None:
    """Count a victim's slots as free again on the machines the waiting job could take."""
    for w in victim.workers:
        if w in avail:
            avail[w] = min(nodes[w].slots, avail[w] + _frees(victim, w, nodes))


def _choose(need: fit.Need, avail: dict[str, int], budget: Mapping[str, int], victims: list[Running],
            nodes: Mapping[str, Node], first: Callable[[Running], tuple]) -> tuple[list[Running], list[str]] | None:
    """Victims that free one machine for each node the job lacks, and the machines its nodes go to (no victims
    when what is free or on its way is enough); None when no set of candidates does."""
    spare = {w: avail[w] - budget.get(w, 0) for w in avail}  # what the job could take of each machine
    machines = sorted((w for w in spare if spare[w] >= need.slots), key=lambda w: (spare[w] - need.slots, w))
    machines = machines[:need.nodes]
    on: dict[str, list[Running]] = defaultdict(list)  # machine -> its candidates, in the order they are taken
    for r in victims:
        for w in r.workers:
            if w in spare:
                on[w].append(r)
    chosen: list[Running] = []
    while len(machines) < need.nodes:
        options = [o for m, there in on.items() if m not in machines
                   if (o := _option(m, there, need, spare, need.nodes - len(machines), nodes, first))]
        if not options:
            return None
        best = min(options, key=lambda o: o.rank)
        chosen.extend(best.victims)
        for r in best.victims:
            _give_back(r, avail, nodes)
            for w in r.workers:
                if w in spare:
                    spare[w] = avail[w] - budget.get(w, 0)
                    on[w] = [v for v in on[w] if v.id != r.id]
        machines.extend(best.machines[:need.nodes - len(machines)])
    return chosen, machines


def _option(m: str, there: list[Running], need: fit.Need, spare: Mapping[str, int], wanted: int,
            nodes: Mapping[str, Node], first: Callable[[Running], tuple]) -> _Option | None:
    """The fewest of `there` (in victim order) that free machine m for one node, and what that costs; None when
    even all of them do not."""
    lacking = need.slots - spare[m]
    picked: list[Running] = []
    freed = 0
    for r in there:
        if freed >= lacking:
            break
        picked.append(r)
        freed += _frees(r, m, nodes)
    if freed < lacking:
        return None
    for r in reversed(list(picked)):  # the last ones first: one the others free enough without is spared
        if freed - _frees(r, m, nodes) >= lacking:
            picked.remove(r)
            freed -= _frees(r, m, nodes)
    # Other machines the same victims ready for a node (a gang's other workers) serve the job's other nodes.
    gain: dict[str, int] = defaultdict(int)
    for r in picked:
        for w in r.workers:
            if w != m and w in spare:
                gain[w] += _frees(r, w, nodes)
    also = sorted((w for w, g in gain.items() if spare[w] < need.slots <= spare[w] + g),
                  key=lambda w: (spare[w] + gain[w] - need.slots, w))
    ready = [m, *also][:wanted]
    used = sum(need.slots - max(0, spare[w]) for w in ready)
    beyond = sum(_frees(r, w, nodes) for r in picked for w in r.workers) - used
    return _Option(picked, ready, (beyond, len(picked), -len(ready), [first(r) for r in picked], m))


def _note(need: fit.Need, chosen: list[Running], machines: list[str], nodes: Mapping[str, Node]) -> str | None:
    """What the job waits on, in device terms: the victims it preempts now, or those still handing devices back.

    None on workers of one job at a time: the reason's "waiting for a free worker" already says it all."""
    if all(nodes[w].room is None for w in machines):
        return None
    noun = device_noun(need, nodes[machines[0]])
    each = " each" if len(machines) > 1 else ""
    where = ", ".join(machines)
    if chosen:
        return f"preempting {len(chosen)} lower-priority job(s) on {where} for {need.slots} {noun}{each}"
    if any(nodes[w].free_slots < need.slots for w in machines):
        return f"preempted job(s) are handing back {need.slots} {noun}{each} on {where}"
    return None
