"""Who runs next: the pool's one scheduling decision, pure (no I/O, no clock): a snapshot in, a plan out.

The dispatch path (worker/dispatch.py), the sweeper (pending reasons, preemptions) and GET /v1/queue call
`plan` on a snapshot of the database (service/scheduling/service.py); bench/scheduler_sim.py calls the same
function on a simulated month. The rules, in order:

1. **Priority**: `high` before `normal` before `low` (the job's priority now: aging may have raised it).
2. **Fair share** (policy "fair", the default): among jobs of one priority, the owner who has used the least
   of the pool recently goes first. Usage is device-seconds (slots × nodes × seconds running), decayed with a
   half-life, divided by the weight; teams share first (the team's usage ÷ the team's weight), then the
   team's users (a user without a team is a team of one). Within one owner, first come first served. Placing
   a job in the order charges its owner (and team) what the job would use until its timeout (at most
   CHARGE_CAP_S), so one owner's jobs interleave with the others' rather than all going first.
   Policy "fifo": priority, then submission order.
3. **Quotas**: a team's or a user's `max_slots` bounds the slots its running jobs hold at once; a job over
   it waits (never fails), whatever its place.
4. **Reservations**: the oldest job that needs more than one worker (a gang) and has waited
   `reserve_after_s` reserves the fitting workers whose slots free up first (up to `max_reservations` gangs,
   the oldest first, each among the workers no older one reserved; reservations.py). A worker of one job at a
   time is held whole; a shared worker (issue 30) holds only the gang's slots, named where its devices are known
   (the best-linked set: Plan.kept, which the worker's dispatcher keeps other jobs off), and its other slots
   stay open to any job. Held slots finish what they run, then take only a job whose timeout ends before the
   reservation is expected to be filled (backfill), or a job of higher priority than the gang whose timeout ends
   before the gang's deadline (queued + reserve_after_s + reserve_deadline_s). So priority still comes first
   while a gang is young, yet no later job pushes a gang past its deadline: it starts by then, unless the jobs already
   running on its workers when it reserved them run longer (their own timeouts bound that). A gang that is
   forming (its node 0 claimed) holds the free slots it still needs the same way.
5. **Preemption**: a job of spec priority `high` that has waited `preempt_after_s` and that no free worker fits
   preempts running jobs of strictly lower spec priority that are preemptible and have run `min_runtime_s`,
   freeing only the devices it needs, one machine per node: on each, the fewest victims, the most over their
   share first, then the lowest priority, then the least work lost; among machines, the one that frees the
   fewest devices beyond the need (preemption.py).

Assignments are best-fit (for a job naming a container image, a worker that has it unpacked first: a soft
preference, never a wait, issue 44; then the fitting worker left with the fewest free slots, then
pool.nvlink_preference, then the smallest, then by id), so a small job does not take the big worker or the NVLink
machine a big job needs. A one-node job that fills an NVLink island (8 GPUs where the largest island is 8) takes
only workers with one while a live one fits it, and waits for them (pool.island_floor,
TRAINJOBS_NVLINK_WHOLE_JOBS): its preemptions and estimate too, as they see the workers that fit through the same
`fitting`. A worker is only offered the
jobs assigned to it: every worker that polls computes the same plan from the same rows, and the claim's
compare-and-set decides races.
"""

from collections import defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from heapq import heapify, heappop, heappush

from service.scheduling.pool import (
    CHARGE_CAP_S,
    PRIORITY_RANK,
    Account,
    Node,
    Place,
    Plan,
    Preemption,
    Reservation,
    Running,
    Settings,
    Snapshot,
    Team,
    Waiting,
    device_noun,
)
from service.scheduling.preemption import preempt
from service.scheduling.reservations import held_count, held_devices, reserve, shown
from service.scheduling.room import Fitting, Room
from service.scheduling.waiting import estimate, free_by_eta, wait_reason

# The policy's whole vocabulary, so that its callers need one import (the types live in pool.py).
__all__ = ["CHARGE_CAP_S", "PRIORITY_RANK", "Account", "Node", "Place", "Plan", "Preemption", "Reservation",
           "Running", "Settings", "Snapshot", "Team", "Waiting", "decayed", "order", "plan", "team_of"]


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds")


def decayed(value: float, elapsed_s: float, half_life_s: float) -> float:
    """Usage `elapsed_s` later: halved every half_life_s."""
    return value * 0.5 ** (max(0.0, elapsed_s) / half_life_s) if half_life_s > 0 else value


def team_of(owner: str, accounts: Mapping[str, Account]) -> str:
    """The owner's team; a user without one is a team of one (named by the user, marked so no team clashes)."""
    team = accounts.get(owner, Account()).team
    return team if team else f"user:{owner}"


def order(snap: Snapshot) -> list[Waiting]:
    """The waiting jobs in the order they would start (priority, then fair share or FIFO, then FIFO)."""
    by_priority: dict[int, list[Waiting]] = defaultdict(list)
    for job in snap.waiting:
        by_priority[PRIORITY_RANK.get(job.priority, 1)].append(job)
    out: list[Waiting] = []
    for rank in sorted(by_priority):
        jobs = sorted(by_priority[rank], key=lambda j: (j.submitted, j.id))
        if snap.settings.policy == "fifo":
            out.extend(jobs)
            continue
        out.extend(_fair_order(jobs, snap))
    return out


def _fair_order(jobs: list[Waiting], snap: Snapshot) -> list[Waiting]:
    accounts, teams = snap.accounts, snap.teams
    queues: dict[str, list[Waiting]] = defaultdict(list)
    for job in jobs:  # already in submission order
        queues[job.owner].append(job)
    # Each owner's team and weights, once: the loop below compares every owner at every step.
    team: dict[str, str] = {}
    team_weight: dict[str, float] = {}
    user_weight: dict[str, float] = {}
    for owner in queues:
        account = accounts.get(owner, Account())
        team[owner] = team_of(owner, accounts)
        team_weight[owner] = max(account.weight if team[owner].startswith("user:")
                                 else teams.get(team[owner], Team()).weight, 1e-9)
        user_weight[owner] = max(account.weight, 1e-9)
    user_use = {owner: snap.usage.get(owner, 0.0) for owner in queues}
    team_use: dict[str, float] = defaultdict(float)
    for owner, used in snap.usage.items():
        team_use[team_of(owner, accounts)] += used
    heads = dict.fromkeys(queues, 0)  # owner -> index of its next job

    def key(owner: str) -> tuple:
        head = queues[owner][heads[owner]]
        return (team_use[team[owner]] / team_weight[owner], user_use[owner] / user_weight[owner],
                head.submitted, head.id)

    # The owner whose key is least goes next. A charge only raises keys (its team's members' too), so a heap of
    # keys as they were is a heap of lower bounds: the top is the least once its key is still what it was.
    heap = [(key(owner), owner) for owner in heads]
    heapify(heap)
    out = []
    while heap:
        was, owner = heappop(heap)
        if (now := key(owner)) != was:
            heappush(heap, (now, owner))
            continue
        job = queues[owner][heads[owner]]
        heads[owner] += 1
        out.append(job)
        charge = job.need.slots * job.need.nodes * min(job.timeout_s, CHARGE_CAP_S)
        user_use[owner] += charge
        team_use[team[owner]] += charge
        if heads[owner] < len(queues[owner]):
            heappush(heap, (key(owner), owner))
        if charge < 0:  # NOTE: a negative timeout would lower keys: the bounds no longer hold, so make them anew
            heap = [(key(o), o) for _, o in heap]
            heapify(heap)
    return out


def plan(snap: Snapshot) -> Plan:
    now, cfg = snap.now, snap.settings
    ordered = order(snap)
    fitting = Fitting(list(snap.nodes), cfg.nvlink_whole_jobs)
    room = Room(snap.nodes, fitting)
    kept: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)  # worker -> job -> devices held for it

    # Slots held now, per user and per team, for quotas.
    held_user: dict[str, int] = defaultdict(int)
    held_team: dict[str, int] = defaultdict(int)
    for r in snap.running:
        held_user[r.owner] += r.slots * r.nodes
    for owner, slots in held_user.items():
        held_team[team_of(owner, snap.accounts)] += slots

    # A forming gang holds the free slots it still needs (one node a worker), before anything else.
    for r in snap.running:
        if r.forming and r.need is not None:
            want = r.nodes - len(r.workers)
            for w in sorted((n for n in fitting(r.need) if n.id not in r.workers and room.open[n.id] >= r.need.slots),
                            key=lambda n: (n.slots, n.id))[:want]:
                room.hold(w.id, r.need.slots, f"joining the forming gang of job {r.id}")
                if (devices := held_devices(w, r.need.slots, r.need.slots, (), now, now, kept[w.id])) is not None:
                    kept[w.id][r.id] = devices

    places: dict[str, Place] = {}
    # NOTE: a gang over its quota could not start on the workers it held, and once all are free the fill time is
    # now, so nothing could backfill them: they would idle until the quota frees. It reserves nothing.
    gangs = [j for j in ordered if j.need.nodes > 1 and now - j.queued >= cfg.reserve_after_s
             and (j.not_before is None or j.not_before <= now) and _quota_block(j, snap, held_user, held_team) is None]
    reservations = reserve(gangs, snap, fitting, dict(room.open), kept)
    reserved: dict[str, Reservation] = {}  # worker -> the reservation that holds it (idle or busy)
    mine: dict[str, Reservation] = {r.job_id: r for r in reservations}
    by_id = {j.id: j for j in ordered}
    for reservation in reservations:
        job = by_id[reservation.job_id]
        for w, devices in reservation.devices.items():
            kept[w][job.id] = devices
        if reservation.held == len(reservation.workers):
            # Filled: it starts now on its reserved workers (node 0 on any of them; the rest join the gang).
            for w in reservation.workers:
                room.take(w, job.need.slots)
            places[job.id] = Place(job.id, job.owner, 0, None, list(reservation.workers), now)
            _hold(job, snap, held_user, held_team)
            continue
        for w in reservation.workers:
            reserved[w] = reservation
            node = room.nodes[w]
            why = f"reserved for job {job.id} (needs {job.need.nodes} nodes)" + (
                f" holding {shown(reservation, w, device_noun(job.need, node))}" if node.room is not None else "")
            room.hold(w, held_count(reservation, node), why, reservation=True)

    # Assign in order, best fit; a job that waits holds back the jobs behind it that compete for the same workers.
    ahead = _Ahead()
    for job in ordered:
        if job.id in places:
            continue
        place = places[job.id] = Place(job.id, job.owner, 0, None)
        view = room.view(job.need)
        if job.not_before is not None and job.not_before > now:
            place.reason = f"retry backoff until {_iso(job.not_before)}"
        elif len(view.fits) < job.need.nodes:
            place.reason = fitting.misfit_reason(job.need) or "no live worker fits"
        elif (why := _quota_block(job, snap, held_user, held_team)) is not None:
            place.reason = why
        # Open slots, and the held slots of a reserved worker whose reservation lets this job take them
        # (backfill, or a job of higher priority that ends before the gang's deadline).
        elif (chosen := view.best(job, reserved, job.id not in mine, now)) is not None:
            for w in chosen:
                room.take(w, job.need.slots)
            place.workers = chosen
            place.estimated_start = now
            _hold(job, snap, held_user, held_team)
        else:  # it waits for workers that fit: jobs behind it that need them wait behind it
            place.reason = wait_reason(job, view, mine.get(job.id), ahead.of(job, view.ids), cfg.policy,
                                       fitting.island_wait(job.need))
            ahead.add(job, view.ids)
    for i, job in enumerate(ordered):
        places[job.id].position = i + 1
    order_out = [places[j.id] for j in ordered]
    estimate(order_out, ordered, fitting, free_by_eta(snap), now)

    preemptions, notes = preempt(ordered, places, snap, fitting, reserved)
    for job_id, note in notes.items():  # what it waits on, in device terms
        places[job_id].reason = f"{places[job_id].reason}; {note}" if places[job_id].reason else note
    shares = {o: u / max(snap.accounts.get(o, Account()).weight, 1e-9) for o, u in snap.usage.items()}
    team_use: dict[str, float] = defaultdict(float)
    for owner, used in snap.usage.items():
        team_use[team_of(owner, snap.accounts)] += used
    team_shares = {t: u / max(snap.teams.get(t, Team()).weight, 1e-9) for t, u in team_use.items()
                   if not t.startswith("user:")}
    return Plan(order_out, preemptions, reservations, shares, team_shares, dict(kept))


class _Ahead:
    """The jobs waiting so far, per set of workers that fit them: those ahead of a job are the ones whose set
    overlaps its own (they compete for a worker it could take)."""

    def __init__(self) -> None:
        self.at: dict[frozenset[str], dict[str, int]] = {}  # set -> priority -> jobs waiting
        self.own: dict[frozenset[str], dict[tuple[str, str], int]] = {}  # set -> (owner, priority) -> jobs waiting
        self.overlap: dict[tuple[int, int], bool] = {}  # by the sets' ids: Room.view keeps one object per set

    def of(self, job: Waiting, ids: frozenset[str]) -> tuple[int, int, int]:
        """(of a higher priority, of its priority and other owners, its owner's), waiting ahead of `job`."""
        rank = PRIORITY_RANK.get(job.priority, 1)
        higher = same = own = 0
        for other, at in self.at.items():
            key = (id(other), id(ids))
            if (meets := self.overlap.get(key)) is None:
                meets = self.overlap[key] = not other.isdisjoint(ids)
            if meets:
                higher += sum(n for p, n in at.items() if PRIORITY_RANK.get(p, 1) < rank)
                same += at.get(job.priority, 0)
                own += self.own[other].get((job.owner, job.priority), 0)
        return higher, same - own, own

    def add(self, job: Waiting, ids: frozenset[str]) -> None:
        at, own = self.at.setdefault(ids, {}), self.own.setdefault(ids, {})
        at[job.priority] = at.get(job.priority, 0) + 1
        own[job.owner, job.priority] = own.get((job.owner, job.priority), 0) + 1


def _hold(job: Waiting, snap: Snapshot, held_user: dict, held_team: dict) -> None:
    held_user[job.owner] += job.need.slots * job.need.nodes
    held_team[team_of(job.owner, snap.accounts)] += job.need.slots * job.need.nodes


def _quota_block(job: Waiting, snap: Snapshot, held_user: dict, held_team: dict) -> str | None:
    want = job.need.slots * job.need.nodes
    account = snap.accounts.get(job.owner, Account())
    team = team_of(job.owner, snap.accounts)
    team_quota = snap.teams.get(team, Team()).max_slots if not team.startswith("user:") else None
    if team_quota is not None and held_team[team] + want > team_quota:
        return f"over team quota {team}: {held_team[team]}/{team_quota} slots in use, needs {want}"
    if account.max_slots is not None and held_user[job.owner] + want > account.max_slots:
        return f"over user quota {job.owner}: {held_user[job.owner]}/{account.max_slots} slots in use, needs {want}"
    return None
