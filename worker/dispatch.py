"""Dequeue by the scheduler's plan: a worker takes the queue entry of the job the plan gives it, if any.

RQ's own dequeue pops the head of a queue, whatever it is. Here a worker first looks at the gang node tasks
(a gang that has begun to form gets its workers before anything starts) and takes one it fits; then it plans
the pool (service/scheduling/policy.py: priority, fair share, quotas, reservations, best fit) on a snapshot of
the database and removes, with LREM, the entry of the first job assigned to it: LREM's count says which worker
won it. A job no worker may take now stays on its queue and queued; the sweeper writes why (pending_reason).
The claim's compare-and-set in the database still decides who runs it.

An entry is only a hint, and anything that reached Redis may have written it: a stale entry (its job no longer
queued, or no job at all) is removed, never run, and an entry that names anything but the service's two job
functions with the arguments the service writes is removed and logged as a security event (queue.refusal).
"""

import dataclasses
import fcntl
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE
from service.jobs import service as jobs
from service.jobs.queue import GANG, SECURITY, parse_node_task_id, refusal
from service.scheduling import placement, policy
from service.scheduling import service as scheduling
from service.settings import Settings
from service.workers import fit, holds
from service.workers import service as workers
from trainjobs.states import JobStatus
from worker import devices

log = logging.getLogger(__name__)
SCAN = 200  # gang node tasks looked at per pass
SCAN_JOBS = 5000  # entries of each priority queue looked at per pass
POLL_S = 0.5  # between passes while nothing fits


class Chooser:
    """This worker's view: what it offers, and the database to read jobs from."""

    def __init__(self, sessions: sessionmaker[Session], offer: fit.Offer, settings: Settings,
                 pressure: Callable[[], str | None] = lambda: None):
        self.sessions, self.offer, self.settings = sessions, offer, settings
        self.pressure = pressure  # why this worker must take no job now (a full disk), or None
        self.lost_after_s = settings.lease_s
        self.reqs: dict[str, scheduling.Req] = {}  # the same, for the scheduler's snapshot
        self.node_slots: dict[str, int] = {}  # gang node task -> the slots its node needs (from takes)
        self.machine = getattr(offer, "machine", None)
        self.shared = getattr(offer, "max_jobs", 1) > 1
        # The lanes of one worker take entries one at a time (the holds' key would refuse a second taker anyway).
        self.lock_path = settings.runs_dir / f".take-{offer.id.replace('/', '_')}.lock" if self.shared else None
        # From the last plan: the devices held here for a job (a reservation's, a forming gang's), and those a
        # reservation lets a job take (backfill that ends before it fills). Other jobs keep off them.
        self.kept: dict[str, tuple[int, ...]] = {}
        self.let: dict[str, set[int]] = {}

    @contextmanager
    def taking(self):
        """Held while this lane plans and takes: its sibling lanes then plan on the holds it took."""
        if self.lock_path is None:
            yield
            return
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def hold(self, entry: str) -> bool:
        """Take this worker's devices for the entry's node (the best linked free set, placement.choose); False
        when too few are free now (a sibling lane took them): the entry goes back to its queue."""
        key = parse_node_task_id(entry)
        job_id, node_rank = (key[0], key[2]) if key else (entry, 0)
        need = self.node_slots.get(entry) if key else (self.reqs[entry].need.slots if entry in self.reqs else None)
        if self.machine is None or need is None:
            return True  # nothing to hold by (a test's bare offer): the job gets the whole worker, as before
        with self.sessions() as db:
            # Its GPUs' health as the heartbeat last reported it: one turned unhealthy is left out (worker/devices.py).
            machine = devices.with_health(self.machine, devices.reported_health(
                workers.device_rows(db, worker_id=self.offer.id)))
            free = {d.index for d in machine.devices} - set(holds.held(db, worker_id=self.offer.id))
            chosen = self.pick(machine, free, need, job_id)
            if chosen is None:
                log.info("job %s: %d of %d devices free on %s now; its entry goes back", job_id, len(free), need,
                         self.offer.id)
                return False
            taken = holds.take(db, worker_id=self.offer.id, job_id=job_id, node_rank=node_rank, devices=list(chosen))
            if taken:
                log.info("job %s: node %d takes device(s) %s of %s (free: %s)", job_id, node_rank, list(chosen),
                         self.offer.id, sorted(free))
            return taken

    def pick(self, machine: placement.Machine, free: set[int], need: int, job_id: str) -> tuple[int, ...] | None:
        """The devices a job's node gets of those free: a job the plan holds devices for gets exactly them; any
        other job the best linked set of the rest, else (as the plan places it: open slots first) of those too
        that a reservation lets it take."""
        own = self.kept.get(job_id)
        if own is not None and len(own) == need and {d.index for d in machine.devices if d.healthy
                                                     and d.index in free}.issuperset(own):
            return own
        others = set().union(*(d for j, d in self.kept.items() if j != job_id))
        chosen = placement.choose(machine, free - others, need)
        if chosen is None and self.let.get(job_id):
            chosen = placement.choose(machine, free - (others - self.let[job_id]), need)
        return chosen

    def plan(self, db: Session, entries: dict[str, str]) -> policy.Plan:
        """The pool's plan, as this worker sees it: polling for work, it is live and free whatever its row says;
        a queued job without a queue entry (being claimed, or lost with Redis until the sweeper enqueues it
        again) is not planned, so it holds no worker."""
        snap = scheduling.snapshot(db, self.settings, cache=self.reqs)
        room, devices_now = None, {}
        if self.shared:  # a shared worker's room: its free slots, as its holds say now
            mine = holds.held(db, worker_id=self.offer.id)
            rows = workers.device_rows(db, worker_id=self.offer.id)
            room = scheduling.room_of(self.offer.slots, self.offer.max_jobs, holds.load_of(mine), rows)
            if rows:  # its devices as the scheduler's snapshot of its row sees them (and as `hold` takes them)
                devices_now = scheduling.devices_of(self.offer.id, self.offer.device, rows, mine)
        me = policy.Node(id=self.offer.id, device=self.offer.device, slots=self.offer.slots,
                         memory_bytes=self.offer.memory_bytes, labels=dict(self.offer.labels or {}), room=room,
                         **devices_now)
        snap = dataclasses.replace(snap, nodes=[*(n for n in snap.nodes if n.id != me.id), me],
                                   waiting=[w for w in snap.waiting if w.id in entries])
        plan = policy.plan(snap)
        self.kept = plan.kept.get(me.id, {})
        here = [r for r in plan.reservations if me.id in r.devices]
        self.let = {w.id: set().union(*(r.devices[me.id] for r in here if r.job_id != w.id and r.lets(w, snap.now)))
                    for w in snap.waiting}
        return plan

    def choose(self, db: Session, entries: dict[str, str]) -> tuple[list[str], list[str]]:
        """Of the priority queues' entries (id -> queue): the stale ones (no queued job of that id), and those
        this worker takes, in order (the jobs the plan assigns it)."""
        mine = self.plan(db, entries).for_worker(self.offer.id)
        queued = scheduling.queued_among(db, list(entries))
        return [e for e in entries if e not in queued], [j for j in mine if j in entries]

    def takes(self, db: Session, entry_ids: list[str], *, gang: bool = True) -> tuple[list[str], list[str]]:
        """The stale gang node tasks (their attempt gone by), and those this worker would take, in queue order.

        A node task is looked at every pass: whether its gang still forms changes.
        """
        keys = {e: parse_node_task_id(e) for e in entry_ids}
        rows = jobs.dispatch_view(db, job_ids={k[0] for k in keys.values() if k})
        # A node of a gang is a machine: a shared worker that runs one node of a job takes no other node of it.
        here = {job for job, _ in holds.held(db, worker_id=self.offer.id).values()} if self.shared else set()
        stale, chosen = [], []
        for entry, key in keys.items():
            row = rows.get(key[0]) if key else None
            if row is None or row.status != JobStatus.STARTING or row.attempt != key[1]:
                stale.append(entry)
            elif key[0] in here:
                continue
            elif fit.misfit(need := fit.need_of(row.spec, row.plan), self.offer) is None:
                self.node_slots[entry] = need.slots
                chosen.append(entry)
        return stale, chosen


class FittingQueue(Queue):
    """RQ's Queue with a dequeue that skips what this worker cannot fit (set `chooser` once per process)."""

    chooser: Chooser | None = None

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis, job_class=None,
                    serializer=None, death_penalty_class=None):
        queues = list(queues)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found = None
            # Under disk pressure: nothing, until space is back.
            queues_now = queues if cls.chooser.pressure() is None else []
            for queue in (q for q in queues_now if q.name.endswith(f"-{GANG}")):
                found = found or cls._take_node_task(queue, connection, job_class, serializer)
            found = found or cls._take_planned([q for q in queues_now if not q.name.endswith(f"-{GANG}")],
                                               connection, job_class, serializer)
            if found is not None:
                return found
            if deadline is None:
                return None
            if time.monotonic() >= deadline:
                raise DequeueTimeout(timeout, [q.key for q in queues])
            time.sleep(POLL_S)

    @classmethod
    def _take_node_task(cls, queue: Queue, connection: Redis, job_class, serializer):
        ids = [i.decode() if isinstance(i, bytes) else i for i in connection.lrange(queue.key, 0, SCAN - 1)]
        if not ids:
            return None
        with cls.chooser.taking():
            try:
                with cls.chooser.sessions() as db:
                    stale, wanted = cls.chooser.takes(db, ids, gang=True)
            except UNREACHABLE:  # take nothing while the database is out: a claim could not be made anyway
                log.warning("the database is out of reach; taking no job until it is back")
                return None
            cls._remove_stale(stale, {e: queue for e in stale}, connection, job_class, serializer)
            return cls._take(wanted, {e: queue for e in wanted}, connection, job_class, serializer)

    @classmethod
    def _take_planned(cls, queues: list[Queue], connection: Redis, job_class, serializer):
        entries: dict[str, Queue] = {}
        for queue in queues:
            for i in connection.lrange(queue.key, 0, SCAN_JOBS - 1):
                entries.setdefault(i.decode() if isinstance(i, bytes) else i, queue)
        if not entries:
            cls.chooser.kept, cls.chooser.let = {}, {}  # nothing planned: no device is held for a queued job
            return None  # nothing queued: no database round trip
        with cls.chooser.taking():
            try:
                with cls.chooser.sessions() as db:
                    stale, wanted = cls.chooser.choose(db, {e: q.name for e, q in entries.items()})
            except UNREACHABLE:
                log.warning("the database is out of reach; taking no job until it is back")
                return None
            cls._remove_stale(stale, entries, connection, job_class, serializer)
            return cls._take(wanted, entries, connection, job_class, serializer)

    @classmethod
    def _remove_stale(cls, stale: list[str], entries: dict[str, Queue], connection: Redis, job_class, serializer):
        """Take each stale entry off its queue, unrun. Its hash goes too while RQ says it waits (never taken): a
        hash RQ marked started or finished is the bookkeeping of a real run of that id, and keeps its TTL."""
        for entry in stale:
            queue = entries[entry]
            if connection.lrem(queue.key, 1, entry) != 1:
                continue
            try:
                job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                           serializer=serializer or queue.serializer)
            except NoSuchJobError:
                continue
            if (why := refusal(job)) is not None:
                cls._refuse(job, queue, why)
            elif job.get_status(refresh=False) == "queued":  # RQ's own status of the hash
                job.delete(remove_from_queue=False)
            log.info("removed stale queue entry %s from %s (no queued job of that id)", entry, queue.name)

    @classmethod
    def _take(cls, wanted: list[str], entries: dict[str, Queue], connection: Redis, job_class, serializer):
        for entry in wanted:
            queue = entries[entry]
            if connection.lrem(queue.key, 1, entry) != 1:
                continue  # another worker took it first
            try:  # RQ's public fetch, with the worker's job class and serializer (as its own dequeue does)
                job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                           serializer=serializer or queue.serializer)
            except NoSuchJobError:  # its hash expired or was deleted: nothing to run
                continue
            if (why := refusal(job)) is not None:
                cls._refuse(job, queue, why)
                continue
            try:
                held = cls.chooser.hold(entry)
            except UNREACHABLE:
                log.warning("the database is out of reach; job %s goes back to its queue", entry)
                held = False
            if not held:
                connection.lpush(queue.key, entry)  # back at the head, for a worker (or a later pass) with room
                continue
            return job, queue
        return None

    @staticmethod
    def _refuse(job, queue: Queue, why: str) -> None:
        """A queue entry the service never wrote: logged as a security event, its hash deleted, nothing run."""
        log.error("%s: worker refused queue entry %s on %s: %s (removed, not run; who can write to this Redis?)",
                  SECURITY, job.id, queue.name, why)
        try:
            job.delete(remove_from_queue=False)
        except Exception:  # noqa: BLE001 - a payload RQ cannot even delete: its hash stays, unrun
            log.exception("could not delete the refused entry %s", job.id)
