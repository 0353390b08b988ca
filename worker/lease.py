"""An attempt's hold on its job: the lease, renewed on a thread and a connection of its own (DESIGN.md rule 5).

Shipping (a job's output and metrics) and the lease never share a transaction: no amount of data a job writes,
nor a slow or refused ship, keeps the lease from being renewed, so a worker is lost only when it is. The thread
renews every heartbeat_s while the supervisor's loop is alive (it calls tick() on every pass); a supervisor stuck
for longer than a lease lets the lease run out, as a frozen worker would, and the sweeper takes the job back.
Each renewal also reads what the job asks of its attempt (cancel, preemption, stacks): Lease.held.
"""

import logging
import threading
import time
from datetime import datetime

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, is_refusal
from service.jobs import lifecycle
from service.settings import Settings
from worker.control import ApiControl, Revoked

log = logging.getLogger(__name__)


class Lease:
    """Renews one node's lease of one attempt from a daemon thread, from start() to stop()."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings, *, job_id: str, attempt: int,
                 node_rank: int = 0, api: ApiControl | None = None):
        self.sessions, self.settings, self.api = sessions, settings, api  # api: renewed through it (issue 42)
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
        """Renew now, in a transaction of its own; False when it could not (lost, or the database is away)."""
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
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:  # the API away, or refusing the request
            log.warning("job %s: the API did not renew the lease (%s); will retry", self.job_id, exc)
            return False
        except UNREACHABLE as exc:
            if is_refusal(exc):
                log.exception("job %s: the database refused the lease renewal; will retry", self.job_id)
            else:  # the supervisor stops the ranks once the lease runs out unrenewed
                log.warning("job %s: the database is out of reach (%s); the lease renewal will retry", self.job_id,
                            type(exc).__name__)
            return False
        except Exception:  # noqa: BLE001 - a blip must never end the thread: the next beat tries again
            log.exception("renewing the lease of job %s failed; will retry", self.job_id)
            return False
        # Counted from before the request: the database's lease ends no earlier.
        self.ends, self.held = asked + self.settings.lease_s, held
        return True

    def _hold(self) -> lifecycle.Held | None:
        """Renew, through the API where this worker joined one, else in a transaction of its own."""
        if self.api is not None:
            held = self.api.renew(job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank)
            if held is None:
                return None
            at = held["stacks_requested_at"]
            return lifecycle.Held(**{**held, "stacks_requested_at": datetime.fromisoformat(at) if at else None})
        with self.sessions() as db:
            held = lifecycle.hold(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank,
                                  lease_s=self.settings.lease_s)
            if held is None:
                db.rollback()
                return None
            db.commit()
        return held

    def _loop(self) -> None:
        while not self._stopped.wait(self.settings.heartbeat_s):
            if self.lost:
                return
            if time.monotonic() > self._alive_until:
                log.error("job %s: its supervisor has not moved for %.0fs; the lease is left to run out", self.job_id,
                          time.monotonic() - self._alive_until + self.settings.lease_s)
                continue
            self.renew()
