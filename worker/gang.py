"""A multi-node job's gang: nodes join by compare-and-set, wait for each other, and form, time out or yield together.

Node 0 is the worker the scheduling pass assigned it to, which claims the job (worker/agent.py); the pass assigned
every other node to a worker too, and once node 0 claimed puts each node's task on its worker's queue
(service/jobs/assigner.py), whose worker joins: its node's attempt row is inserted under the
job's row lock, while the job is still `starting` at that attempt (the unique (job, attempt, node) makes a second
join of the same node fail). Every member renews its lease while it waits. Once all nodes are in, node 0's look
records the endpoint it proposes (a port free on its reachable address) and moves the job to `running` in one
compare-and-set; then every node launches torchrun against that endpoint.

No worker waits forever: a gang not formed within TRAINJOBS_GANG_TIMEOUT_S releases its workers and goes
back to the queue. Two half-formed gangs cannot deadlock: the younger one (started later) yields to an older
one that still lacks nodes this worker could fill, so the oldest gang always gets every worker it needs.

The compare-and-sets themselves (join, check_gang, release_gang) are in service/jobs/lifecycle.py, reached through
the worker protocol's calls gang_join, gang_check and gang_release (service/runners/attempt_calls.py); this
module is the worker's side: the waiting.
"""

import logging
import socket
import time
from collections.abc import Callable

from service.settings import Settings
from service.workers import fit
from trainjobs.spec import JobSpec
from worker.control import Control, Unreachable

log = logging.getLogger(__name__)


def join(control: Control, *, job_id: str, attempt: int, node_rank: int, worker: str) -> JobSpec | None:
    """Take node `node_rank` of the gang forming for `attempt`; None when it formed, moved on or is taken."""
    answer = control.call("gang_join", {"job_id": job_id, "attempt": attempt, "node_rank": node_rank,
                                        "worker_id": worker})
    return JobSpec.model_validate(answer["spec"]) if answer["joined"] else None


def wait_formed(control: Control, *, settings: Settings, job_id: str, attempt: int, node_rank: int,
                offer: fit.Offer, address: str, stopping: Callable[[], bool] = lambda: False) -> tuple[str | None, str]:
    """Wait for the whole gang: (endpoint, "formed"), else (None, why): lost | cancelled | timeout | yielded |
    preempted (this worker is shutting down: the gang lets go and goes back to the queue)."""
    ref = {"job_id": job_id, "attempt": attempt, "node_rank": node_rank}
    offered = {"device": offer.device, "slots": offer.slots, "memory_bytes": offer.memory_bytes,
               "labels": dict(offer.labels or {})}
    look = {**ref, "worker_id": offer.id, "offer": offered}
    while True:
        if node_rank == 0:  # the rendezvous, should the gang form at this look: a port free here now
            look["endpoint"] = f"{address}:{free_port(address)}"
        try:
            answer = control.call("gang_check", look)
            endpoint, why = answer["endpoint"], answer["state"]
            if why == "waiting" and stopping() and control.call(
                    "gang_release", {**ref, "why": f"node {node_rank}'s worker is shutting down"})["released"]:
                endpoint, why = None, "preempted"
        except Unreachable as exc:  # keep waiting: the gang's lease (and its timeout) decide, once it answers
            log.warning("job %s node %s: the control plane is out of reach while the gang forms (%s)", job_id,
                        node_rank, exc)
            endpoint, why = None, "waiting"
        if why != "waiting":
            return endpoint, why
        time.sleep(settings.poll_s)


def free_port(address: str) -> int:
    """A port free on `address` now (torchrun on node 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
