"""Dequeue what the control plane assigned: a worker takes the entries on its own queue, and gang node tasks it fits.

The scheduler runs in the control plane (service/jobs/assigner.py): one plan per pass assigns each job it starts
to a worker and its devices, holds them, and moves the job's entry onto that worker's own queue
(`<prefix>-w-<worker id>`). A lane here pops that queue (BLPOP: an assignment is taken the moment it lands) and only
checks that the job still fits (the `assignment` call, service/runners/assign_calls.py: still its assignment, its
devices healthy and held for it); one that does not is given back there. It reads no pool and runs no plan. The
claim's compare-and-set in the database still decides who runs a job.

A gang's node tasks (nodes 1.. of a job whose node 0 is claimed) wait on the gang queue, served first: a lane takes
one its worker fits (the `node_tasks` call says which, service/runners/node_calls.py), with devices of its own (the
`node_hold` call: placement's best linked free set, held; a shared worker's lanes take them one at a time, a file
lock), as before the one scheduler; the pass's plan keeps their workers' room for them.

An entry is only a hint, and anything that reached Redis may have written it: a stale entry (its job no longer
queued, not assigned to this worker, or no job at all) is removed, never run, and an entry that names anything but
the service's two job functions with the arguments the service writes is removed and logged as a security event
(queue.refusal).
"""

import fcntl
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.queue import GANG, PRIORITIES, SECURITY, kick, parse_node_task_id, refusal
from service.settings import Settings
from service.workers import fit
from worker.control import Control, Refused, Unreachable, for_worker

log = logging.getLogger(__name__)
SCAN = 200  # gang node tasks looked at per pass
POLL_S = 0.5  # the longest a lane waits on its own queue before it looks at the gang queue again


class Taker:
    """This worker's side of dispatch: what it offers, how it reaches the control plane, and its own holds (the
    gang node tasks it takes)."""

    def __init__(self, sessions: sessionmaker[Session] | None, offer: fit.Offer, settings: Settings,
                 pressure: Callable[[], str | None] = lambda: None, control: Control | None = None):
        self.sessions, self.offer, self.settings = sessions, offer, settings
        self.pressure = pressure  # why this worker must take no job now (a full disk), or None
        self.control = control
        self.node_slots: dict[str, int] = {}  # gang node task -> the slots its node needs (from takes)
        self.machine = getattr(offer, "machine", None)
        self.shared = getattr(offer, "max_jobs", 1) > 1
        # The lanes of one worker take node tasks one at a time (the holds' key would refuse a second taker anyway).
        self.lock_path = settings.runs_dir / f".take-{offer.id.replace('/', '_')}.lock" if self.shared else None

    def calls(self) -> Control:
        if self.control is None:  # made in the lane that uses it (a lane is a fork: no connection inherited)
            self.control = for_worker(self.settings, self.sessions)
        return self.control

    def assigned(self, job_id: str) -> dict:
        """The control plane's answer on an entry of this worker's queue (assign_calls.Assigned as a dict)."""
        return self.calls().call("assignment", {"worker_id": self.offer.id, "job_id": job_id})

    def give_back(self, job_id: str, reason: str) -> None:
        try:
            self.calls().call("give_back", {"worker_id": self.offer.id, "job_id": job_id, "reason": reason})
        except (Unreachable, Refused) as exc:  # the next pass finds it unclaimed and plans it again
            log.warning("job %s: could not give it back now (%s); the scheduler will", job_id, exc)

    @contextmanager
    def taking(self):
        """Held while this lane takes a node task: its sibling lanes then see the holds it took."""
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
        """Take this worker's devices for a gang node task (the control plane picks the best linked free set of
        its healthy devices, as its heartbeat last reported them); False when too few are free now (a sibling lane
        took them): the entry goes back to its queue."""
        job_id, _, node_rank = parse_node_task_id(entry)
        need = self.node_slots.get(entry)
        if self.machine is None or need is None:
            return True  # nothing to hold by (a test's bare offer): the node gets the whole worker, as before
        held = self.calls().call("node_hold", {"worker_id": self.offer.id, "job_id": job_id, "node_rank": node_rank,
                                               "slots": need})
        if not held["taken"]:
            log.info("job %s: its node task goes back (%s)", job_id, held.get("reason"))
        else:
            log.info("job %s: node %d takes device(s) %s of %s", job_id, node_rank, held.get("devices"),
                     self.offer.id)
        return held["taken"]

    def takes(self, entry_ids: list[str]) -> tuple[list[str], list[str]]:
        """The stale gang node tasks (their attempt gone by), and those this worker would take, in queue order
        (the control plane's `node_tasks` call judges them against this worker's row).

        A node task is looked at every pass: whether its gang still forms changes.
        """
        answer = self.calls().call("node_tasks", {"worker_id": self.offer.id, "entries": entry_ids})
        for found in answer["fits"]:
            self.node_slots[found["entry"]] = found["slots"]
        return answer["stale"], [found["entry"] for found in answer["fits"]]


class FittingQueue(Queue):
    """RQ's Queue with a dequeue that takes this worker's assignments and the node tasks it fits (set `taker`
    once per process)."""

    taker: Taker | None = None

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis, job_class=None,
                    serializer=None, death_penalty_class=None):
        queues = list(queues)
        gang = [q for q in queues if q.name.endswith(f"-{GANG}")]
        own = [q for q in queues if q not in gang]
        deadline = None if timeout is None else time.monotonic() + timeout
        kick(connection, prefix=cls.taker.settings.queue_prefix)  # idle again: its freed devices get a pass soon
        while True:
            found = None
            wait = 0.0 if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            if cls.taker.pressure() is None:  # under disk pressure: nothing, until space is back
                for queue in gang:
                    found = found or cls._take_node_task(queue, connection, job_class, serializer)
                found = found or cls._take_assigned(own, connection, job_class, serializer, wait)
            elif wait:
                time.sleep(wait)
            if found is not None:
                return found
            if deadline is None:
                return None
            if time.monotonic() >= deadline:
                raise DequeueTimeout(timeout, [q.key for q in queues])

    @classmethod
    def _take_node_task(cls, queue: Queue, connection: Redis, job_class, serializer):
        ids = [i.decode() if isinstance(i, bytes) else i for i in connection.lrange(queue.key, 0, SCAN - 1)]
        if not ids:
            return None
        with cls.taker.taking():
            try:
                stale, wanted = cls.taker.takes(ids)
            except (Unreachable, Refused) as exc:  # take nothing while the control plane is away: nor could a claim
                log.warning("the control plane did not answer on the gang's node tasks (%s); taking none now", exc)
                return None
            cls._remove_stale(stale, queue, connection, job_class, serializer)
            return cls._take(wanted, queue, connection, job_class, serializer)

    @classmethod
    def _take_assigned(cls, queues: list[Queue], connection: Redis, job_class, serializer, wait: float):
        """Pop this worker's own queue (waiting up to `wait` s for an entry) until an entry is still its to run."""
        if not queues:
            return None
        keys = [q.key for q in queues]
        while True:
            popped = connection.blpop(keys, timeout=wait) if wait > 0 else next(
                (item for k in keys if (item := (k, connection.lpop(k)))[1] is not None), None)
            if popped is None:
                return None
            key, entry = (v.decode() if isinstance(v, bytes) else v for v in popped)
            queue = next(q for q in queues if q.key == key)
            found = cls._keep(entry, queue, connection, job_class, serializer)
            if found != "next":
                return found
            wait = 0.0  # the next entry, if one is there now

    @classmethod
    def _keep(cls, entry: str, queue: Queue, connection: Redis, job_class, serializer):
        """An entry popped off this worker's queue: (job, queue) to run, None to stop looking now, or "next"."""
        try:  # RQ's public fetch, with the worker's job class and serializer (as its own dequeue does)
            job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                       serializer=serializer or queue.serializer)
        except NoSuchJobError:  # its hash expired or was deleted (a cancel): nothing to run; any assignment goes
            log.info("removed queue entry %s from %s: no such job in the queue", entry, queue.name)
            cls.taker.give_back(entry, "its queue entry had no job")
            return "next"
        if (why := refusal(job)) is not None:
            cls._refuse(job, queue, why)
            cls.taker.give_back(entry, "its queue entry was refused")  # a real job behind it is enqueued anew
            return "next"
        if (why := cls.taker.pressure()) is not None:
            cls.taker.give_back(entry, f"{cls.taker.offer.id} is under pressure: {why}")
            return None
        try:
            answer = cls.taker.assigned(entry)
        except Unreachable as exc:  # back at the head of its queue, for a later try (or the pass takes it back)
            log.warning("job %s: the control plane is out of reach (%s); its entry waits", entry, exc)
            connection.lpush(queue.key, entry)
            time.sleep(POLL_S)
            return None
        except Refused as exc:
            log.error("job %s: the control plane refused its assignment (%s); its entry is removed", entry, exc)
            return "next"
        if answer["state"] != "run":
            if answer["state"] == "stale":
                cls._forget(job)
            log.info("job %s: not run here (%s: %s)", entry, answer["state"], answer.get("reason"))
            return "next"
        return job, cls._origin(job, queue)

    @classmethod
    def _origin(cls, job, fallback: Queue) -> Queue:
        """The job's own priority queue (its `origin`): RQ keeps its started and finished registries there, where
        the reconciler looks (queue.reconcile); an origin it never wrote: the queue it came from."""
        if any(job.origin == f"{cls.taker.settings.queue_prefix}-{p}" for p in PRIORITIES):
            return cls(job.origin, connection=fallback.connection, serializer=fallback.serializer,
                       job_class=fallback.job_class)
        return fallback

    @classmethod
    def _remove_stale(cls, stale: list[str], queue: Queue, connection: Redis, job_class, serializer):
        """Take each stale node task off its queue, unrun."""
        for entry in stale:
            if connection.lrem(queue.key, 1, entry) != 1:
                continue
            try:
                job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                           serializer=serializer or queue.serializer)
            except NoSuchJobError:
                continue
            if (why := refusal(job)) is not None:
                cls._refuse(job, queue, why)
            else:
                cls._forget(job)
            log.info("removed stale queue entry %s from %s (no forming gang of that attempt)", entry, queue.name)

    @staticmethod
    def _forget(job) -> None:
        """A stale entry's hash goes too while RQ says it waits (never taken): a hash RQ marked started or finished
        is the bookkeeping of a real run of that id, and keeps its TTL."""
        if job.get_status(refresh=False) == "queued":  # RQ's own status of the hash
            job.delete(remove_from_queue=False)

    @classmethod
    def _take(cls, wanted: list[str], queue: Queue, connection: Redis, job_class, serializer):
        for entry in wanted:
            if connection.lrem(queue.key, 1, entry) != 1:
                continue  # another worker took it first
            try:
                job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                           serializer=serializer or queue.serializer)
            except NoSuchJobError:  # its hash expired or was deleted: nothing to run
                continue
            if (why := refusal(job)) is not None:
                cls._refuse(job, queue, why)
                continue
            try:
                held = cls.taker.hold(entry)
            except (Unreachable, Refused) as exc:
                log.warning("the control plane did not answer (%s); node task %s goes back to its queue", exc, entry)
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
