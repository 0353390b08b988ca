"""The plan as it walked before its indexes (service/scheduling/room.py; main at 56449b5): slow, and kept only to
check the fast one against (tests/test_plan_equivalence.py).

What changed is here as it was: the placing loop (its `usable` walk over every worker that fits, the jobs ahead
counted over every set of workers seen), `wait_reason` over every worker that fits, and `estimate` sorting every
worker that fits for each job. The rest (the order, quotas, reservations, preemption, the Room's accounting) is
the policy's own, called as plan calls it.
"""

from collections import defaultdict

from service.scheduling import policy
from service.scheduling.pool import (
    PRIORITY_RANK,
    Account,
    Node,
    Place,
    Plan,
    Reservation,
    Snapshot,
    Team,
    Waiting,
    device_noun,
    nvlink_preference,
)
from service.scheduling.preemption import preempt
from service.scheduling.reservations import held_count, held_devices, reserve, shown
from service.scheduling.room import Fitting, Room
from service.scheduling.waiting import free_by_eta
from service.workers import fit


def plan(snap: Snapshot) -> Plan:
    now, cfg = snap.now, snap.settings
    ordered = policy.order(snap)
    fitting = Fitting(list(snap.nodes), cfg.nvlink_whole_jobs)
    room = Room(snap.nodes, fitting)
    kept: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
    held_user: dict[str, int] = defaultdict(int)
    held_team: dict[str, int] = defaultdict(int)
    for r in snap.running:
        held_user[r.owner] += r.slots * r.nodes
        held_team[policy.team_of(r.owner, snap.accounts)] += r.slots * r.nodes
    for r in snap.running:
        if r.forming and r.need is not None:
            want = r.nodes - len(r.workers)
            for w in sorted((n for n in fitting(r.need) if n.id not in r.workers and room.open[n.id] >= r.need.slots),
                            key=lambda n: (n.slots, n.id))[:want]:
                room.hold(w.id, r.need.slots, f"joining the forming gang of job {r.id}")
                if (devices := held_devices(w, r.need.slots, r.need.slots, (), now, now, kept[w.id])) is not None:
                    kept[w.id][r.id] = devices
    places: dict[str, Place] = {}
    gangs = [j for j in ordered if j.need.nodes > 1 and now - j.queued >= cfg.reserve_after_s
             and (j.not_before is None or j.not_before <= now)
             and policy._quota_block(j, snap, held_user, held_team) is None]
    reservations = reserve(gangs, snap, fitting, dict(room.open), kept)
    reserved: dict[str, Reservation] = {}
    mine = {r.job_id: r for r in reservations}
    by_id = {j.id: j for j in ordered}
    for reservation in reservations:
        job = by_id[reservation.job_id]
        for w, devices in reservation.devices.items():
            kept[w][job.id] = devices
        if reservation.held == len(reservation.workers):
            for w in reservation.workers:
                room.take(w, job.need.slots)
            places[job.id] = Place(job.id, job.owner, 0, None, list(reservation.workers), now)
            policy._hold(job, snap, held_user, held_team)
            continue
        for w in reservation.workers:
            reserved[w] = reservation
            node = room.nodes[w]
            why = f"reserved for job {job.id} (needs {job.need.nodes} nodes)" + (
                f" holding {shown(reservation, w, device_noun(job.need, node))}" if node.room is not None else "")
            room.hold(w, held_count(reservation, node), why, reservation=True)
    waiting_by_fit: dict[frozenset[str], dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    for job in ordered:
        if job.id in places:
            continue
        place = places[job.id] = Place(job.id, job.owner, 0, None)
        fits = fitting.by_id(job.need)
        fit_ids = frozenset(w.id for w in fits)
        counts: dict[tuple, int] = defaultdict(int)
        for ids, seen in waiting_by_fit.items():
            if ids & fit_ids:
                for key, n in seen.items():
                    counts[key] += n
        rank = PRIORITY_RANK.get(job.priority, 1)
        own = counts["own", job.owner, job.priority]
        ahead = (sum(n for key, n in counts.items() if key[0] == "at" and PRIORITY_RANK.get(key[1], 1) < rank),
                 counts["at", job.priority] - own, own)
        if job.not_before is not None and job.not_before > now:
            place.reason = f"retry backoff until {policy._iso(job.not_before)}"
        elif len(fits) < job.need.nodes:
            place.reason = fit.pending_reason(job.need, list(snap.nodes)) or "no live worker fits"
        elif (why := policy._quota_block(job, snap, held_user, held_team)) is not None:
            place.reason = why
        else:
            usable = [w for w in fits if room.open[w.id] >= job.need.slots or (
                w.id in reserved and job.id not in mine and room.usable(w.id, True) >= job.need.slots
                and reserved[w.id].lets(job, now))]
            usable.sort(key=lambda n: (room.free[n.id] - job.need.slots,
                                       nvlink_preference(job.need.slots, n.nvlink_island), n.slots, n.id))
            if len(usable) >= job.need.nodes:
                chosen = usable[:job.need.nodes]
                for w in chosen:
                    room.take(w.id, job.need.slots)
                place.workers = [w.id for w in chosen]
                place.estimated_start = now
                policy._hold(job, snap, held_user, held_team)
            else:
                place.reason = wait_reason(job, fits, room, mine.get(job.id), ahead, cfg.policy,
                                           fitting.island_wait(job.need))
                waiting_by_fit[fit_ids]["at", job.priority] += 1
                waiting_by_fit[fit_ids]["own", job.owner, job.priority] += 1
    for i, job in enumerate(ordered):
        places[job.id].position = i + 1
    order_out = [places[j.id] for j in ordered]
    estimate(order_out, ordered, fitting, free_by_eta(snap), now)
    preemptions, notes = preempt(ordered, places, snap, fitting, reserved)
    for job_id, note in notes.items():
        places[job_id].reason = f"{places[job_id].reason}; {note}" if places[job_id].reason else note
    shares = {o: u / max(snap.accounts.get(o, Account()).weight, 1e-9) for o, u in snap.usage.items()}
    team_use: dict[str, float] = defaultdict(float)
    for owner, used in snap.usage.items():
        team_use[policy.team_of(owner, snap.accounts)] += used
    team_shares = {t: u / max(snap.teams.get(t, Team()).weight, 1e-9) for t, u in team_use.items()
                   if not t.startswith("user:")}
    return Plan(order_out, preemptions, reservations, shares, team_shares, dict(kept))


def wait_reason(job: Waiting, fits: list[Node], room: Room, reservation: Reservation | None,
                ahead: tuple[int, int, int], policy_name: str, island: bool = False) -> str:
    higher, share, own = ahead
    need = job.need
    partial = [w for w in fits if 0 < room.open[w.id] < need.slots]
    if reservation is not None:
        noun = device_noun(need, room.nodes[reservation.workers[0]])
        why = (f"needs {need.nodes} nodes: reserved, {reservation.held} of {len(reservation.workers)} held " + (
            f"({need.slots} {noun} on each of {', '.join(reservation.workers)})" if not reservation.devices
            else f"({', '.join(shown(reservation, w, noun) for w in reservation.workers)})"))
    elif island:
        ranked = sorted(fits, key=lambda w: (-room.open[w.id], w.id))
        listed = ", ".join(f"{w.id}: {room.open[w.id]} free" + (f" ({room.why[w.id]})" if w.id in room.why else "")
                           for w in ranked[:5]) + (f", {len(fits) - 5} more" if len(fits) > 5 else "")
        why = f"needs {need.slots} GPUs on one NVLink island; every worker with one is busy ({listed})"
    elif partial and need.nodes == 1:
        largest = max(partial, key=lambda w: (room.open[w.id], w.id))
        why = (f"needs {need.slots} {device_noun(need, largest)} on one node; the largest free set is "
               f"{room.open[largest.id]}, on {largest.id}") + (f"; {room.why[largest.id]}"
                                                                if largest.id in room.why else "")
    else:
        busy = sum(1 for w in fits if room.open[w.id] <= 0 and w.id not in room.why)
        held = [room.why[w.id] for w in fits if w.id in room.why]
        why = f"waiting for a free worker: {len(fits)} fit, {busy} busy"
        if held:
            why += f", {len(held)} {held[0]}" + (" (backfill needs a timeout that ends before it fills)"
                                                 if "reserved" in held[0] else "")
        if need.nodes > 1:
            why = f"needs {need.nodes} nodes; " + why
    behind = []
    if higher:
        behind.append(f"{higher} higher-priority job(s)")
    if share:
        behind.append(f"{share} job(s) of users with less usage" if policy_name == "fair"
                      else f"{share} earlier job(s)")
    if own:
        behind.append(f"{own} earlier job(s) of yours")
    return why + ("; behind " + ", ".join(behind) if behind else "")


def estimate(order_out: list[Place], ordered: list[Waiting], fitting: Fitting, free_at: dict[str, float],
             now: float) -> None:
    timeline = dict(free_at)
    for place, job in zip(order_out, ordered, strict=True):
        if place.workers:
            for w in place.workers:
                timeline[w] = now + job.timeout_s
            continue
        if place.reason and (place.reason.startswith(("no live worker", "needs", "over ")) and
                             "fit," not in place.reason and "reserved" not in place.reason
                             and "NVLink island;" not in place.reason):
            continue
        fits = sorted(fitting(job.need), key=lambda n: timeline[n.id])
        if len(fits) < job.need.nodes:
            continue
        chosen = fits[:job.need.nodes]
        start = max(timeline[n.id] for n in chosen)
        place.estimated_start = start
        for n in chosen:
            timeline[n.id] = start + job.timeout_s

