"""Capacity-aware dequeue: a worker takes a queue entry only for a job it can fit.

RQ's own dequeue pops the head of a queue, whatever it is; a job then reaches a worker that cannot run it
and would have to be put back (and bounce from worker to worker). Here a worker looks at the first
entries of each queue in order (gang node tasks, then high, normal, low), asks the database what each job
needs (service/workers/fit.py) and removes, with LREM, only an entry it fits: LREM's count says which
worker won it. A job that no worker fits stays on its queue and queued; the sweeper writes why
(pending_reason). The claim's compare-and-set in the database still decides who runs it.
"""

import logging
import time
from collections.abc import Iterable

from redis import Redis
from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE
from service.jobs import service as jobs
from service.jobs.queue import GANG, parse_node_task_id
from service.workers import fit
from service.workers import service as workers
from trainjobs.states import JobStatus

log = logging.getLogger(__name__)
SCAN = 200  # entries looked at per queue and pass
CACHE_MAX = 10_000  # needs remembered (a job's spec and plan never change)
POLL_S = 0.5  # between passes while nothing fits


class Chooser:
    """This worker's view: what it offers, and the database to read jobs from."""

    def __init__(self, sessions: sessionmaker[Session], offer: fit.Offer, *, lost_after_s: float):
        self.sessions, self.offer, self.lost_after_s = sessions, offer, lost_after_s
        self.needs: dict[str, fit.Need] = {}  # queued jobs already looked at: no query for them next pass

    def takes(self, db: Session, entry_ids: list[str], *, gang: bool) -> list[str]:
        """The entries this worker would take, in queue order."""
        keys = {e: (parse_node_task_id(e) if gang else (e, None, None)) for e in entry_ids}
        # A gang's node task is looked at every pass: whether its gang still forms changes.
        job_ids = {k[0] for k in keys.values() if k and (gang or k[0] not in self.needs)}
        rows = jobs.dispatch_view(db, job_ids=job_ids)
        if len(self.needs) > CACHE_MAX:
            self.needs.clear()
        live = None
        chosen = []
        for entry, key in keys.items():
            need = self.needs.get(key[0]) if key and not gang else None
            if need is None:
                row = rows.get(key[0]) if key else None
                wanted = JobStatus.STARTING if gang else JobStatus.QUEUED
                if row is None or row.status != wanted or (gang and row.attempt != key[1]):
                    chosen.append(entry)  # stale: taking it just drops it (the job function skips it)
                    continue
                need = fit.need_of(row.spec, row.plan)
                if not gang:
                    self.needs[row.id] = need
            if fit.misfit(need, self.offer) is not None:
                continue
            if not gang and need.nodes > 1:  # start a gang only where enough live workers could join it
                live = live if live is not None else workers.live(db, lost_after_s=self.lost_after_s)
                if len(fit.fitting(need, live)) < need.nodes:
                    continue
            chosen.append(entry)
        return chosen


class FittingQueue(Queue):
    """RQ's Queue with a dequeue that skips what this worker cannot fit (set `chooser` once per process)."""

    chooser: Chooser | None = None

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis, job_class=None,
                    serializer=None, death_penalty_class=None):
        queues = list(queues)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for queue in queues:
                found = cls._take_one(queue, connection, job_class, serializer, death_penalty_class)
                if found is not None:
                    return found
            if deadline is None:
                return None
            if time.monotonic() >= deadline:
                raise DequeueTimeout(timeout, [q.key for q in queues])
            time.sleep(POLL_S)

    @classmethod
    def _take_one(cls, queue: Queue, connection: Redis, job_class, serializer, death_penalty_class):
        ids = [i.decode() if isinstance(i, bytes) else i for i in connection.lrange(queue.key, 0, SCAN - 1)]
        if not ids:
            return None
        try:
            with cls.chooser.sessions() as db:
                wanted = cls.chooser.takes(db, ids, gang=queue.name.endswith(f"-{GANG}"))
        except UNREACHABLE:  # take nothing while the database is out: a claim could not be made anyway
            log.warning("the database is out of reach; taking no job until it is back")
            return None
        for entry in wanted:
            if connection.lrem(queue.key, 1, entry) != 1:
                continue  # another worker took it first
            try:  # RQ's public fetch, with the worker's job class and serializer (as its own dequeue does)
                job = (job_class or queue.job_class).fetch(entry, connection=connection,
                                                           serializer=serializer or queue.serializer)
            except NoSuchJobError:  # its hash expired or was deleted: nothing to run
                continue
            return job, queue
        return None
