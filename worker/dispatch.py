"""Dequeue what the control plane assigned: a worker takes the entries on its own queue, a gang's node tasks too.

The scheduler runs in the control plane (service/jobs/assigner.py): one plan per pass assigns each job it starts
to a worker and its devices, holds them, and moves the job's entry onto that worker's own queue
(`<prefix>-w-<worker id>`). A lane here pops that queue (BLPOP: an assignment is taken the moment it lands) and only
checks that the job still fits (the `assignment` call, service/runners/assign_calls.py: still its assignment, its
devices healthy and held for it); one that does not is given back there. It reads no pool and runs no plan. The
claim's compare-and-set in the database still decides who runs a job.

A gang's nodes are assigned by the same pass, each to a worker and its devices; once node 0 claims the job, each
other node's task (`run_node(job, attempt, node)`) lands on its worker's own queue, and a lane takes it as any
other entry: the `assignment` call says whether it is still its to run (its gang forming at that attempt, its
devices held for it), then the node joins the gang (worker/agent.py run_node). No worker takes a node by fit.

An entry is only a hint, and anything that reached Redis may have written it: a stale entry (its job no longer
queued, not assigned to this worker, or no job at all) is removed, never run, and an entry that names anything but
the service's two job functions with the arguments the service writes is removed and logged as a security event
(queue.refusal).
"""

import logging
import time
from collections.abc import Callable, Iterable

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.queue import PRIORITIES, SECURITY, kick, parse_node_task_id, refusal
from service.settings import Settings
from service.workers import fit
from worker.control import Control, Refused, Unreachable, for_worker

log = logging.getLogger(__name__)
POLL_S = 0.5  # the longest a lane waits on its own queue at once (then it looks at its disk and its timeout)


class Taker:
    """This worker's side of dispatch: what it offers and how it reaches the control plane."""

    def __init__(self, sessions: sessionmaker[Session] | None, offer: fit.Offer, settings: Settings,
                 pressure: Callable[[], str | None] = lambda: None, control: Control | None = None):
        self.sessions, self.offer, self.settings = sessions, offer, settings
        self.pressure = pressure  # why this worker must take no job now (a full disk), or None
        self.control = control

    def calls(self) -> Control:
        if self.control is None:  # made in the lane that uses it (a lane is a fork: no connection inherited)
            self.control = for_worker(self.settings, self.sessions)
        return self.control

    def ref(self, entry: str) -> dict:
        """The assignment an entry stands for: a job's (node 0), or a gang node task's (job, attempt, node)."""
        task = parse_node_task_id(entry)
        if task is None:
            return {"worker_id": self.offer.id, "job_id": entry}
        job_id, attempt, node_rank = task
        return {"worker_id": self.offer.id, "job_id": job_id, "node_rank": node_rank, "attempt": attempt}

    def assigned(self, entry: str) -> dict:
        """The control plane's answer on an entry of this worker's queue (assign_calls.Assigned as a dict)."""
        return self.calls().call("assignment", self.ref(entry))

    def give_back(self, entry: str, reason: str) -> None:
        try:
            self.calls().call("give_back", {**self.ref(entry), "reason": reason})
        except (Unreachable, Refused) as exc:  # the next pass finds it unclaimed and plans it again
            log.warning("entry %s: could not give it back now (%s); the scheduler will", entry, exc)


class FittingQueue(Queue):
    """RQ's Queue with a dequeue that takes only what the control plane assigned this worker, each entry checked
    with it first (set `taker` once per process)."""

    taker: Taker | None = None

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis, job_class=None,
                    serializer=None, death_penalty_class=None):
        queues = list(queues)  # its own queue (and the retired gang queue worker/main.py still names: judged alike)
        deadline = None if timeout is None else time.monotonic() + timeout
        kick(connection, prefix=cls.taker.settings.queue_prefix)  # idle again: its freed devices get a pass soon
        while True:
            found = None
            wait = 0.0 if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            if cls.taker.pressure() is None:  # under disk pressure: nothing, until space is back
                found = cls._take_assigned(queues, connection, job_class, serializer, wait)
            elif wait:
                time.sleep(wait)
            if found is not None:
                return found
            if deadline is None:
                return None
            if time.monotonic() >= deadline:
                raise DequeueTimeout(timeout, [q.key for q in queues])

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

    @staticmethod
    def _forget(job) -> None:
        """A stale entry's hash goes too while RQ says it waits (never taken): a hash RQ marked started or finished
        is the bookkeeping of a real run of that id, and keeps its TTL."""
        if job.get_status(refresh=False) == "queued":  # RQ's own status of the hash
            job.delete(remove_from_queue=False)

    @staticmethod
    def _refuse(job, queue: Queue, why: str) -> None:
        """A queue entry the service never wrote: logged as a security event, its hash deleted, nothing run."""
        log.error("%s: worker refused queue entry %s on %s: %s (removed, not run; who can write to this Redis?)",
                  SECURITY, job.id, queue.name, why)
        try:
            job.delete(remove_from_queue=False)
        except Exception:  # noqa: BLE001 - a payload RQ cannot even delete: its hash stays, unrun
            log.exception("could not delete the refused entry %s", job.id)
