"""An attempt's hold on its job: the lease, renewed on a thread of its own through the protocol's `leases` call
(worker/control.py: the API, or in-process for a database worker), DESIGN.md rule 5.

A joined worker's renewals ride its tick (worker/tick.py) with its attempts' batches, but never behind more than
1 MiB of them, and a batch refused is refused alone: no amount of data a job writes, nor a slow or refused ship,
keeps the lease from being renewed, so a worker is lost only when it is. The thread
renews every heartbeat_s while the supervisor's loop is alive (it calls tick() on every pass); a supervisor stuck
for longer than a lease lets the lease run out, as a frozen worker would, and the sweeper takes the job back.
Each renewal also reads what the job asks of its attempt (cancel, preemption, stacks): Lease.held.
"""

import logging
import threading
import time
from datetime import datetime

from service.jobs import lifecycle
from service.settings import Settings
from worker.control import Control, Refused, Revoked, Unreachable

log = logging.getLogger(__name__)


class Lease:
    """Renews one node's lease of one attempt from a daemon thread, from start() to stop()."""

    def __init__(self, control: Control, settings: Settings, *, job_id: str, attempt: int, node_rank: int = 0):
        # Renewed through the protocol's `leases` (issue 42): by the API, or in-process for a database worker.
        self.control, self.settings = control, settings
        self.job_id, self.attempt, self.node_rank = job_id, attempt, node_rank
        # When the lease held in the database runs out, as far as this worker knows (the claim or the gang's
        # forming renewed it just before): past it the sweeper may have given the job to another attempt.
        self.ends = time.monotonic() + settings.lease_s
        self.lost = False  # the sweeper (or a cancel of a forming gang) gave the job away: stop, write nothing
        self.held: lifecycle.Held | None = None  # what the latest renewal read of the job
        self._alive_until = time.monotonic() + settings.lease_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Lease":
        self._thread = threading.Thread(target=self._loop, name=f"lease-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.lease_s)

    def tick(self, busy_s: float = 0.0) -> None:
        """The supervisor's loop is alive (and may block for busy_s more, stopping the ranks): keep renewing."""
        self._alive_until = max(self._alive_until, time.monotonic() + self.settings.lease_s + busy_s)

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.ends

    def renew(self) -> bool:
        """Renew now, in a transaction of its own; False when it could not (lost, or the control plane is away)."""
        asked = time.monotonic()
        try:
            held = self._hold()
            if held is None:
                self.lost = True
                return False
        except Revoked as exc:  # the machine's credential revoked: the API took its jobs back
            log.error("job %s: the API refused this machine's credential (%s): stopping the ranks", self.job_id, exc)
            self.lost = True
            return False
        except Unreachable as exc:  # the supervisor stops the ranks once the lease runs out unrenewed
            log.warning("job %s: the lease renewal will retry (%s)", self.job_id, exc)
            return False
        except Refused as exc:
            log.error("job %s: the lease renewal was refused (%s); will retry", self.job_id, exc.detail)
            return False
        except Exception:  # noqa: BLE001 - a blip must never end the thread: the next beat tries again
            log.exception("renewing the lease of job %s failed; will retry", self.job_id)
            return False
        # Counted from before the request: the database's lease ends no earlier.
        self.ends, self.held = asked + self.settings.lease_s, held
        return True

    def _hold(self) -> lifecycle.Held | None:
        """This node's lease renewed by the control plane: what its job asks of it, or None once it lost the job."""
        ref = {"job_id": self.job_id, "attempt": self.attempt, "node_rank": self.node_rank}
        [lease] = self.control.call("leases", {"attempts": [ref]})["leases"]
        held = lease["held"]
        if held is None:
            return None
        at = held["stacks_requested_at"]
        return lifecycle.Held(**{**held, "stacks_requested_at": datetime.fromisoformat(at) if at else None})

    def _loop(self) -> None:
        while not self._stopped.wait(self.settings.heartbeat_s):
            if self.lost:
                return
            if time.monotonic() > self._alive_until:
                log.error("job %s: its supervisor has not moved for %.0fs; the lease is left to run out", self.job_id,
                          time.monotonic() - self._alive_until + self.settings.lease_s)
                continue
            self.renew()
