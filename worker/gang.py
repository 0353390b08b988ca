"""A multi-node job's gang: nodes join by compare-and-set, wait for each other, and form, time out or yield together.

Node 0 is whoever claims the job (worker/agent.py); it enqueues one task per other node (service/jobs/queue.py),
and a worker that fits takes one and joins: it inserts its node's attempt row under the job's row lock,
while the job is still `starting` at that attempt (the unique (job, attempt, node) makes a second join of
the same node fail). Every member renews its lease while it waits. Once all nodes are in, node 0 picks a
free port on its reachable address, records the endpoint and moves the job to `running` in one
compare-and-set; then every node launches torchrun against that endpoint.

No worker waits forever: a gang not formed within TRAINJOBS_GANG_TIMEOUT_S releases its workers and goes
back to the queue. Two half-formed gangs cannot deadlock: the younger one (started later) yields to an older
one that still lacks nodes this worker could fill, so the oldest gang always gets every worker it needs.

The compare-and-sets themselves (join, check_gang, release_gang) are in service/jobs/lifecycle.py; this
module is the worker's side: the waiting.
"""

import logging
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE
from service.jobs import lifecycle
from service.settings import Settings
from service.workers import fit
from trainjobs.spec import JobSpec

log = logging.getLogger(__name__)


def join(sessions: sessionmaker[Session], *, settings: Settings, job_id: str, attempt: int, node_rank: int,
         worker: str) -> JobSpec | None:
    """Take node `node_rank` of the gang forming for `attempt`; None when it formed, moved on or is taken."""
    with sessions() as db:
        spec = lifecycle.join(db, job_id=job_id, attempt=attempt, node_rank=node_rank, worker=worker,
                              lease_s=settings.lease_s)
        db.commit()
        return spec


def wait_formed(sessions: sessionmaker[Session], *, settings: Settings, job_id: str, attempt: int, node_rank: int,
                offer: fit.Offer, address: str, stopping: Callable[[], bool] = lambda: False) -> tuple[str | None, str]:
    """Wait for the whole gang: (endpoint, "formed"), else (None, why): lost | cancelled | timeout | yielded |
    preempted (this worker is shutting down: the gang lets go and goes back to the queue)."""
    while True:
        try:
            with sessions() as db:
                endpoint, why = lifecycle.check_gang(db, job_id=job_id, attempt=attempt, node_rank=node_rank,
                                                     lease_s=settings.lease_s, gang_timeout_s=settings.gang_timeout_s,
                                                     offer=offer, address=address)
                if why == "waiting" and stopping():
                    lifecycle.release_gang(db, job_id=job_id, attempt=attempt,
                                           why=f"node {node_rank}'s worker is shutting down")
                    endpoint, why = None, "preempted"
                db.commit()
        except UNREACHABLE:  # keep waiting: the gang's lease (and its timeout) decide, once the database is back
            log.warning("job %s node %s: the database is out of reach while the gang forms", job_id, node_rank)
            endpoint, why = None, "waiting"
        if why != "waiting":
            return endpoint, why
        time.sleep(settings.poll_s)
