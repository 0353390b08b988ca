"""What the plan hands out (policy.plan), kept so that a pass costs little more than its jobs and workers.

`Fitting`: the live workers that fit a need, once per distinct need. `Room`: each live worker's free slots as the
plan hands them out, and those held for a gang. `View`: one need's workers with indexes the Room keeps current as
it hands slots out (best fit, the largest partial set, the busy count), so a job that cannot start is not a walk
over every worker that fits it: with 2,000 queued jobs on 1,000 workers, those walks were most of a plan
(bench/README.md, "One scheduler's pass").

Every index answers exactly what the walk it replaces answered (tests/test_plan_equivalence.py pins it against the
walks kept there). They rely on one fact: while the plan places jobs a worker's slots only ever go (`hold`,
`take`), so an entry is stale once its worker changed (a version per worker) and the change pushes a fresh one.
"""

from collections import defaultdict
from collections.abc import Mapping, Sequence
from heapq import heapify, heappop, heappush

from service.scheduling.pool import Node, Reservation, Waiting, nvlink_preference, whole_island
from service.workers import fit


class Fitting:
    """The live workers that fit a need, in the snapshot's order: computed once per distinct need in a plan.

    Hundreds of waiting jobs share a handful of needs; calling fit.misfit for every job × worker in each of
    plan's passes was most of its time (bench/scheduler_sim.py).

    A one-node job that fills an NVLink island gets only the workers with one while a live one fits it
    (pool.whole_island, Settings.nvlink_whole_jobs): so its place, its preemptions (preemption.py) and its
    estimate all wait for NVLink alike, and so would a reservation (reservations.py: gangs, which it spares)."""

    def __init__(self, nodes: Sequence[Node], whole_islands: bool = True) -> None:
        self.nodes = nodes
        self.whole_islands = whole_islands
        self.cache: dict[tuple, list[Node]] = {}
        self.cache_by_id: dict[tuple, list[Node]] = {}
        self.left_out: dict[tuple, int] = {}  # need -> workers that fit it but lack the island it waits for
        self.misfits: dict[tuple, str | None] = {}  # need -> fit.pending_reason, for those too few workers fit
        self.keys: dict[int, tuple[fit.Need, tuple]] = {}  # id(need) -> (need, its key): jobs share Need objects

    def key(self, need: fit.Need) -> tuple:
        """What tells one need from another: every field of it."""
        known = self.keys.get(id(need))
        if known is not None and known[0] is need:
            return known[1]
        key = (need.device, need.slots, need.memory_bytes, need.memory_device, tuple(sorted(need.labels.items())),
               need.pip, need.entrypoint, need.nodes, need.image)
        self.keys[id(need)] = (need, key)
        return key

    def __call__(self, need: fit.Need) -> list[Node]:
        key = self.key(need)
        found = self.cache.get(key)
        if found is None:
            found = [n for n in self.nodes if fit.misfit(need, n) is None]
            if self.whole_islands and (narrowed := whole_island(need, found)) is not None:
                self.left_out[key] = len(found) - len(narrowed)
                found = narrowed
            self.cache[key] = found
        return found

    def island_wait(self, need: fit.Need) -> bool:
        """Whether the job waits for an NVLink island that some worker fitting it otherwise lacks."""
        self(need)
        return self.left_out.get(self.key(need), 0) > 0

    def by_id(self, need: fit.Need) -> list[Node]:
        key = self.key(need)
        found = self.cache_by_id.get(key)
        if found is None:
            found = self.cache_by_id[key] = sorted(self(need), key=lambda n: n.id)
        return found

    def misfit_reason(self, need: fit.Need) -> str | None:
        """fit.pending_reason over every live worker, once per need (it names each worker's misfit)."""
        key = self.key(need)
        if key not in self.misfits:
            self.misfits[key] = fit.pending_reason(need, list(self.nodes))
        return self.misfits[key]


class Room:
    """Each live worker's free slots as the plan hands them out, and those of them held for a gang."""

    def __init__(self, nodes: Sequence[Node], fitting: Fitting) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.fitting = fitting
        self.free = {n.id: n.free_slots for n in nodes}
        self.open = dict(self.free)  # free slots that no gang holds
        self.reserved: dict[str, int] = defaultdict(int)  # held for a reservation: a job it lets may take them
        self.why: dict[str, str] = {}  # worker -> why others may not take its held slots
        self.version = dict.fromkeys(self.nodes, 0)  # bumped at each change: older index entries are stale
        self.rank = {w: i for i, w in enumerate(sorted(self.nodes))}  # by id, for "the largest id" in a heap
        self.views: dict[tuple, View] = {}
        self.members: dict[str, list[View]] = defaultdict(list)  # worker -> the views of needs it fits
        self.sets: dict[frozenset[str], frozenset[str]] = {}  # one object per distinct set of fitting workers

    def hold(self, w: str, slots: int, why: str, *, reservation: bool = False) -> None:
        """Hold `slots` of w's open slots for a gang: a shared worker's other slots stay open (issue 30), a
        worker of one job at a time is held whole."""
        n = self.open[w] if self.nodes[w].room is None else min(self.open[w], slots)
        if n > 0:
            busy = self.busy(w)
            self.open[w] -= n
            self.reserved[w] += n if reservation else 0
            self.why[w] = why
            self._changed(w, busy)

    def usable(self, w: str, let: bool) -> int:
        """Slots a job may take on w: the open ones, and a reservation's held ones where it lets the job."""
        return self.open[w] + (self.reserved[w] if let else 0)

    def take(self, w: str, slots: int) -> None:
        """A job placed on w takes its slots, the open ones first (a worker of one job at a time: all of them)."""
        busy = self.busy(w)
        over = min(self.reserved[w], max(0, slots - self.open[w]))  # taken from a reservation that lets it
        self.reserved[w] -= over
        if self.nodes[w].room is None:
            self.free[w] = self.open[w] = self.reserved[w] = 0
        else:
            self.free[w] -= slots
            self.open[w] -= slots - over
        if self.free[w] <= self.open[w]:  # nothing held any more
            self.why.pop(w, None)
        self._changed(w, busy)

    def busy(self, w: str) -> bool:
        """What a reason counts as busy: nothing open, and not held for a gang (those it names apart)."""
        return self.open[w] <= 0 and w not in self.why

    def _changed(self, w: str, was_busy: bool) -> None:
        self.version[w] += 1
        for view in self.members[w]:
            view.changed(w, was_busy)

    def view(self, need: fit.Need) -> "View":
        """The need's workers and their indexes, made the first time a job asks."""
        key = self.fitting.key(need)
        found = self.views.get(key)
        if found is None:
            fits = self.fitting.by_id(need)
            ids = frozenset(n.id for n in fits)
            found = self.views[key] = View(self, need, fits, self.sets.setdefault(ids, ids))
            for n in fits:
                self.members[n.id].append(found)
        return found


class View:
    """The workers that fit one need (by id) and what the plan asks of them, kept current by the Room.

    Each index is made the first time it is asked, then every change of one of its workers pushes an entry (a
    heap with stale entries left in, dropped when they reach the top)."""

    def __init__(self, room: Room, need: fit.Need, fits: list[Node], ids: frozenset[str]) -> None:
        self.room, self.slots, self.nodes = room, need.slots, need.nodes
        self.image = need.image
        self.digest = need.image.partition("@")[2] or None if need.image else None  # a pinned image's sha256
        self.fits, self.ids = fits, ids
        self.changes = 0  # how many times one of its workers changed: a cached reason is good while unchanged
        self.reason: tuple[int, str] | None = None  # (changes, why) of the last reason without a reservation
        self._best: list[tuple] | None = None  # best fit among those with the job's slots open
        self._partial: list[tuple] | None = None  # the largest partial set: (-open, -rank, version, worker)
        self._most: list[tuple] | None = None  # the most open: (-open, worker, version)
        self._busy: int | None = None

    def changed(self, w: str, was_busy: bool) -> None:
        room, self.changes = self.room, self.changes + 1
        slots, version = room.open[w], room.version[w]
        if self._best is not None and slots >= self.slots:
            heappush(self._best, self._fit_key(w))
        if self._partial is not None and 0 < slots < self.slots:
            heappush(self._partial, (-slots, -room.rank[w], version, w))
        if self._most is not None:
            heappush(self._most, (-slots, w, version))
        if self._busy is not None:
            self._busy += room.busy(w) - was_busy

    def _fit_key(self, w: str) -> tuple:
        # A worker that has the job's image unpacked first (a pull of GBs costs more than a worse fit; issue 44),
        # then best fit: the fewest free slots left (whole machines stay free for big jobs), then NVLink (pool.py).
        node = self.room.nodes[w]
        return ((self.lacks(node), self.room.free[w] - self.slots), nvlink_preference(self.slots, node.nvlink_island),
                node.slots, w, self.room.version[w])

    def lacks(self, node: Node) -> bool:
        """Whether the job's image (if it names one) would have to be pulled there."""
        return self.image is not None and not (self.image in node.images or
                                               (self.digest is not None and self.digest in node.images))

    def best(self, job: Waiting, reserved: Mapping[str, Reservation], let: bool, now: float) -> list[str] | None:
        """The job's workers, best fit first: of those with its slots open, and of the reserved ones whose
        reservation lets it take their held slots (`let`: it is not the gang itself); None when too few."""
        room = self.room
        if self._best is None:
            free, version, slots = room.free, room.version, self.slots
            self._best = [((self.lacks(n), free[n.id] - slots), nvlink_preference(slots, n.nvlink_island), n.slots,
                           n.id, version[n.id]) for n in self.fits if room.open[n.id] >= slots]
            heapify(self._best)
        heap, picked = self._best, []
        while heap and len(picked) < self.nodes:
            entry = heappop(heap)
            if entry[-1] == room.version[entry[3]]:  # an entry is pushed only while the slots are open
                picked.append(entry)
        for entry in picked:  # still good until a job takes them (which pushes fresh ones)
            heappush(heap, entry)
        if let:
            picked += [self._fit_key(w) for w, holder in reserved.items()
                       if w in self.ids and room.open[w] < self.slots and room.usable(w, True) >= self.slots
                       and holder.lets(job, now)]
        if len(picked) < self.nodes:
            return None
        return [entry[3] for entry in sorted(picked)[:self.nodes]]

    def busy(self) -> int:
        """How many of its workers have nothing open and are held for no gang."""
        if self._busy is None:
            free, why = self.room.open, self.room.why
            self._busy = sum(1 for n in self.fits if free[n.id] <= 0 and n.id not in why)
        return self._busy

    def largest_partial(self) -> str | None:
        """Of its workers with some slots open but fewer than the need, the one with the most (then the largest
        id); None when none."""
        room = self.room
        if self._partial is None:
            self._partial = [(-room.open[n.id], -room.rank[n.id], room.version[n.id], n.id) for n in self.fits
                             if 0 < room.open[n.id] < self.slots]
            heapify(self._partial)
        heap = self._partial
        while heap and heap[0][2] != room.version[heap[0][3]]:
            heappop(heap)
        return heap[0][3] if heap else None

    def most_open(self, k: int) -> list[str]:
        """Its k workers with the most slots open (then by id)."""
        room = self.room
        if self._most is None:
            self._most = [(-room.open[n.id], n.id, room.version[n.id]) for n in self.fits]
            heapify(self._most)
        heap, top = self._most, []
        while heap and len(top) < k:
            entry = heappop(heap)
            if entry[2] == room.version[entry[1]]:
                top.append(entry)
        for entry in top:
            heappush(heap, entry)
        return [entry[1] for entry in top]

    def held(self) -> list[str]:
        """Why each of its workers held for a gang is held, by worker id."""
        why = self.room.why
        return [why[w] for w in sorted(w for w in why if w in self.ids)]
