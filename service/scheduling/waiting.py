"""What a waiting job reads (policy.plan): why it waits, in device terms, and when it is expected to start.

Pure functions of the plan's state: the workers that fit a job and what each has open or held (room.py: a need's
View, kept current as the plan hands slots out) and the order; kept apart from the rules that place jobs, which
they only describe.
"""

from collections import defaultdict
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from service.scheduling.pool import CHARGE_CAP_S, Place, Reservation, Snapshot, Waiting, device_noun
from service.scheduling.reservations import shown
from service.workers import fit

if TYPE_CHECKING:
    from service.scheduling.room import Fitting, View


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


def wait_reason(job: Waiting, view: "View", reservation: Reservation | None, ahead: tuple[int, int, int],
                policy: str, island: bool = False) -> str:
    """Why `job` waits: its reservation, the NVLink island it waits for, the largest free set, or the busy
    workers that fit; then the jobs ahead of it."""
    higher, share, own = ahead
    if reservation is not None:
        need = job.need
        noun = device_noun(need, view.room.nodes[reservation.workers[0]])
        why = (f"needs {need.nodes} nodes: reserved, {reservation.held} of {len(reservation.workers)} held " + (
            f"({need.slots} {noun} on each of {', '.join(reservation.workers)})" if not reservation.devices
            else f"({', '.join(shown(reservation, w, noun) for w in reservation.workers)})"))
    elif view.reason is not None and view.reason[0] == view.changes:  # the same workers, as they were
        why = view.reason[1]
    else:
        why = _why(job.need, view, island)
        view.reason = (view.changes, why)
    behind = []
    if higher:
        behind.append(f"{higher} higher-priority job(s)")
    if share:
        behind.append(f"{share} job(s) of users with less usage" if policy == "fair" else f"{share} earlier job(s)")
    if own:
        behind.append(f"{own} earlier job(s) of yours")
    return why + ("; behind " + ", ".join(behind) if behind else "")


def _why(need: fit.Need, view: "View", island: bool) -> str:
    """What a job of this need waits for, without a reservation of its own: the same for every such job while
    its workers are as they were (`View.changes`)."""
    room, fits = view.room, view.fits
    if island:
        # It waits for NVLink though a worker without it fits (pool.island_floor): name the ones it waits for.
        listed = ", ".join(f"{w}: {room.open[w]} free" + (f" ({room.why[w]})" if w in room.why else "")
                           for w in view.most_open(5)) + (f", {len(fits) - 5} more" if len(fits) > 5 else "")
        return f"needs {need.slots} GPUs on one NVLink island; every worker with one is busy ({listed})"
    if need.nodes == 1 and (largest := view.largest_partial()) is not None:
        # A shared worker has room, but not enough on one node: say so in device terms.
        return (f"needs {need.slots} {device_noun(need, room.nodes[largest])} on one node; the largest free set "
                f"is {room.open[largest]}, on {largest}") + (f"; {room.why[largest]}" if largest in room.why else "")
    held = view.held()
    why = f"waiting for a free worker: {len(fits)} fit, {view.busy()} busy"
    if held:
        why += f", {len(held)} {held[0]}" + (" (backfill needs a timeout that ends before it fills)"
                                             if "reserved" in held[0] else "")
    if need.nodes > 1:
        why = f"needs {need.nodes} nodes; " + why
    return why


def estimate(order_out: list[Place], ordered: list[Waiting], fitting: "Fitting", free_at: dict[str, float],
             now: float) -> None:
    """An estimated start for each waiting job: in order, each takes the fitting workers free soonest and holds
    them for its timeout (the bound it may run): so an estimate errs late, never early for a job ahead.

    Per need, a heap of its workers by when they are free (then the snapshot's order, as a stable sort of them
    by that time would give): a job reads its first workers, not a sort of every worker that fits it."""
    timeline = dict(free_at)
    index = {n.id: i for i, n in enumerate(fitting.nodes)}
    version: dict[str, int] = defaultdict(int)
    heaps: dict[tuple, list[tuple]] = {}
    members: dict[str, list[list[tuple]]] = defaultdict(list)  # worker -> the heaps it is in

    def move(w: str, t: float) -> None:
        timeline[w] = t
        version[w] += 1
        for heap in members[w]:
            heappush(heap, (t, index[w], version[w], w))

    for place, job in zip(order_out, ordered, strict=True):
        if place.workers:
            for w in place.workers:
                move(w, now + job.timeout_s)
            continue
        if place.reason and (place.reason.startswith(("no live worker", "needs", "over ")) and
                             "fit," not in place.reason and "reserved" not in place.reason
                             and "NVLink island;" not in place.reason):
            continue
        fits = fitting(job.need)
        if len(fits) < job.need.nodes:
            continue
        key = fitting.key(job.need)
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(timeline[n.id], index[n.id], version[n.id], n.id) for n in fits]
            heapify(heap)
            for n in fits:
                members[n.id].append(heap)
        chosen: list[str] = []
        while len(chosen) < job.need.nodes:
            entry = heappop(heap)
            if entry[2] == version[entry[3]]:
                chosen.append(entry[3])
        start = max(timeline[w] for w in chosen)
        place.estimated_start = start
        for w in chosen:
            move(w, start + job.timeout_s)
