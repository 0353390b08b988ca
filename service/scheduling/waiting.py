"""What a waiting job reads (policy.plan): why it waits, in device terms, and when it is expected to start.

Pure functions of the plan's state: the workers that fit a job (policy._Fitting), what each has open or held
(policy._Room) and the order; kept apart from the rules that place jobs, which they only describe.
"""

from typing import TYPE_CHECKING

from service.scheduling.pool import CHARGE_CAP_S, Node, Place, Reservation, Snapshot, Waiting, device_noun
from service.scheduling.reservations import shown

if TYPE_CHECKING:
    from service.scheduling.policy import _Fitting, _Room


def free_by_eta(snap: Snapshot) -> dict[str, float]:
    """When each live worker is expected free, for the estimates shown to users: now if idle; else by its job's
    progress, at most by its timeout (a bound the supervisor enforces)."""
    running = {r.id: r for r in snap.running}
    out: dict[str, float] = {}
    for n in snap.nodes:
        job = running.get(n.running) if n.running else None
        if n.running is None or n.free_slots == n.slots:
            out[n.id] = snap.now
        elif job is None:  # busy with something the snapshot does not show (a job just claimed)
            out[n.id] = snap.now + CHARGE_CAP_S
        else:
            bound = max(snap.now, job.started + job.timeout_s)
            out[n.id] = min(bound, snap.now + job.eta_s) if job.eta_s is not None else bound
    return out


def wait_reason(job: Waiting, fits: list[Node], room: "_Room", reservation: Reservation | None,
                 ahead: tuple[int, int, int], policy: str, island: bool = False) -> str:
    """Why `job` waits: its reservation, the NVLink island it waits for, the largest free set, or the busy
    workers that fit; then the jobs ahead of it."""
    higher, share, own = ahead
    need = job.need
    partial = [w for w in fits if 0 < room.open[w.id] < need.slots]
    if reservation is not None:
        noun = device_noun(need, room.nodes[reservation.workers[0]])
        why = (f"needs {need.nodes} nodes: reserved, {reservation.held} of {len(reservation.workers)} held " + (
            f"({need.slots} {noun} on each of {', '.join(reservation.workers)})" if not reservation.devices
            else f"({', '.join(shown(reservation, w, noun) for w in reservation.workers)})"))
    elif island:
        # It waits for NVLink though a worker without it fits (pool.island_floor): name the ones it waits for.
        ranked = sorted(fits, key=lambda w: (-room.open[w.id], w.id))
        listed = ", ".join(f"{w.id}: {room.open[w.id]} free" + (f" ({room.why[w.id]})" if w.id in room.why else "")
                           for w in ranked[:5]) + (f", {len(fits) - 5} more" if len(fits) > 5 else "")
        why = f"needs {need.slots} GPUs on one NVLink island; every worker with one is busy ({listed})"
    elif partial and need.nodes == 1:
        # A shared worker has room, but not enough on one node: say so in device terms.
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
        behind.append(f"{share} job(s) of users with less usage" if policy == "fair" else f"{share} earlier job(s)")
    if own:
        behind.append(f"{own} earlier job(s) of yours")
    return why + ("; behind " + ", ".join(behind) if behind else "")


def estimate(order_out: list[Place], ordered: list[Waiting], fitting: "_Fitting", free_at: dict[str, float],
              now: float) -> None:
    """An estimated start for each waiting job: in order, each takes the fitting workers free soonest and holds
    them for its timeout (the bound it may run): so an estimate errs late, never early for a job ahead."""
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
