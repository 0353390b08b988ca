"""Stage 5, ship: the attempt's new output, metric points and what its watch found, moved to the database in
fenced transactions while it runs and until all of it is stored once its ranks are gone."""

import enum
import logging
import math
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, is_refusal
from service.jobs import lifecycle, records
from trainjobs.spec import JobSpec
from worker.lease import Lease
from worker.shipping import LogShipper, MetricTail, OutputPump
from worker.watch import Watch

log = logging.getLogger(__name__)
DRAIN_FIRST_S, DRAIN_MAX_S = 0.2, 3.0  # after the ranks end, retry shipping from every 0.2 s up to every 3 s
DRAIN_REFUSALS = 3  # a commit refused (not an outage) this many times is not retried again
NOTE_EVERY_S = 5.0  # how often the job's note of what the metric caps kept out is updated while it runs


class Shipped(enum.Enum):
    STORED = "stored"  # or the attempt is no longer ours: nothing more to store
    UNREACHABLE = "unreachable"  # the database is down or out of reach: try again, nothing is lost
    REFUSED = "refused"  # the database answered with an error (a bug, or data it will not take)


def work_done(spec: JobSpec, metrics: MetricTail) -> bool:
    """The ranks reported their last step (the spec's max_steps; a script's own total_steps, counted from 0 or
    1): what is left is writing out, not work to stop."""
    total = metrics.total_steps if spec.entrypoint else spec.train.max_steps
    return bool(total) and metrics.last_step >= total - 1


def progress(spec: JobSpec, metrics: MetricTail) -> dict:
    """The job's progress as its ranks reported it. An entrypoint's total is what its script reported
    (report(total_steps=...)), if anything."""
    total = metrics.total_steps if spec.entrypoint else spec.train.max_steps
    step, step_time_s = metrics.last_step, metrics.last_step_time_s
    eta = max(0.0, (total - step) * step_time_s) if total and step_time_s else None
    # NOTE: a script's absurd step times can overflow it, and strict JSON (PostgreSQL's) has no infinity.
    return {"step": step, "total_steps": total, "eta_s": eta if eta is None or math.isfinite(eta) else None,
            **({"performance": dict(metrics.live)} if metrics.live else {})}


class Shipper:
    """Ships one node's attempt; `take_held` reads what the lease's last renewal found (a cancel, a preemption)
    before each ship. The lease is renewed on its own thread (worker/lease.py), never here."""

    def __init__(self, *, sessions: sessionmaker[Session], spec: JobSpec, job_id: str, attempt: int, node_rank: int,
                 gang: bool, lease: Lease, metrics: MetricTail, watch: Watch, take_held: Callable[[], None]):
        self.sessions, self.spec, self.job_id, self.attempt = sessions, spec, job_id, attempt
        self.node_rank, self.gang, self.lease, self.metrics, self.watch = node_rank, gang, lease, metrics, watch
        self.take_held = take_held
        self.logs: LogShipper | None = None  # set once the attempt's log is opened (it reads what is stored)
        self.refused = 0  # shipping transactions the database refused in a row
        self._noted: tuple[str | None, float] = (None, -float("inf"))  # the metric caps' note as last stored, when
        # The progress and resume step as last shipped (written, or left as the job's by a gang's rule), and as
        # the open transaction ships them: each is written only when it changed, so the job's row (and its ETag)
        # moves only when the job does.
        self._shipped: tuple[dict | None, int | None] = (None, None)
        self._shipping: tuple[dict | None, int | None] = (None, None)

    def ship(self, pump: OutputPump | None, *, final: bool = False) -> Shipped:
        """Move new output and metrics to the database, and take in what the lease's last renewal read.

        Fenced (lifecycle.still_held): once the sweeper has given the job to a new attempt (this worker was paused
        or cut off past its lease), nothing more is written for this one. What fails to commit is sent again by
        the next call: nothing is dropped, but for a metric batch the database refuses on its own (ship_apart).
        A ship with nothing new opens no transaction at all: the lease, renewed on its own, is what says the
        worker is alive (and finds a lost job). A final one (the drain's, once per attempt) always does: the ranks
        are gone, and the drain waits to see the database take their last output, however long it is away.
        """
        self.lease.tick()
        self.take_held()
        if pump is not None and (output := pump.take()):
            self.logs.stage(output)
            self.watch.output_seen()
        points = self.metrics.stage()  # the next metric batch, read before any transaction
        if not final and not self._news(points=points):
            self.metrics.committed()  # what it read held no point to store (a summary, thinned steps): read
            return Shipped.STORED
        try:
            shipped = self._commit(lambda db, held: self._write(db, held, final=final)) if not self.refused else \
                self._ship_apart()
        except UNREACHABLE as exc:
            if not is_refusal(exc):
                log.warning("job %s: the database is out of reach (%s); shipping will retry", self.job_id,
                            type(exc).__name__)
                return Shipped.UNREACHABLE
            log.exception("the database refused the shipping of job %s; will retry apart", self.job_id)
        except Exception:  # noqa: BLE001 - a database blip must never kill a healthy run
            log.exception("shipping for job %s failed; will retry apart", self.job_id)
        else:
            self.refused = 0
            return shipped
        self.refused += 1
        return Shipped.REFUSED

    def _ship_apart(self) -> Shipped:
        """After a refused ship: the log and the watch's findings in one transaction, the metrics in another; a
        metric batch the database refuses alone is given up (counted in the job's note, logged), so one bad batch
        never holds back the log, nor every batch after it."""
        self._commit(lambda db, held: self._write(db, held, metrics=False), metrics=False)
        try:
            return self._commit(lambda db, held: self.metrics.write(db, job_id=self.job_id, attempt=self.attempt,
                                                                    node_rank=self.node_rank), logs=False)
        except UNREACHABLE as exc:
            if not is_refusal(exc):
                raise
            refused = exc
        except Exception as exc:  # noqa: BLE001 - data the database will not take: given up below
            refused = exc
        log.error("job %s: the database refused a batch of its metrics on its own (%s); giving it up", self.job_id,
                  refused)
        self.metrics.give_up()
        return Shipped.STORED

    def _commit(self, write, *, logs: bool = True, metrics: bool = True) -> Shipped:
        """`write(db, held)` in a transaction fenced by lifecycle.still_held, then the shippers it wrote for (the
        log and the watch; the metrics) move on; STORED also once the job is lost (nothing more to store)."""
        with self.sessions() as db:
            held = lifecycle.still_held(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank)
            if held is None:
                db.rollback()
                self.lease.lost = True
                return Shipped.STORED
            write(db, held)
            db.commit()
        if metrics:
            self.metrics.committed()
        if logs:
            self.logs.committed()
            self.watch.committed()
            self._shipped = self._shipping
        return Shipped.STORED

    def _news(self, *, points: int) -> bool:
        """Whether this ship has anything to write: points, output, the watch's findings, a changed progress or
        resume step, or a metric caps' note that is due."""
        watch = self.watch
        return bool(points or self.logs.news or watch.warnings_pending or watch.stacks_pending is not None
                    or watch.samples_pending or self._note_due(final=False)
                    or (progress(self.spec, self.metrics), self.metrics.resumed_from_step) != self._shipped)

    def drain(self, pump: OutputPump | None) -> None:
        """The ranks are gone: ship until all they wrote is stored, however long the database is out of reach.

        The outcome is recorded after this, as late as it must be (agent.with_retries): a run that finished
        during an outage is finished, with all its output, metrics and summary, once the database is back.
        Data the database keeps refusing (not an outage: it would be refused forever) is given up, and logged.
        """
        wait, refused = DRAIN_FIRST_S, 0
        while (shipped := self.ship(pump, final=True)) is not Shipped.STORED or (self.metrics.more
                                                                                and not self.lease.lost):
            if shipped is Shipped.STORED:  # a metric backlog: the next batch at once
                continue
            refused += shipped is Shipped.REFUSED
            if refused >= DRAIN_REFUSALS:
                log.error("job %s: the database refused the attempt's last output %d times; giving it up",
                          self.job_id, refused)
                return
            time.sleep(wait)
            wait = min(DRAIN_MAX_S, wait * 2)
        if self.metrics.note() != self._noted[0]:  # the last batch's counts: the job's note says them too
            self.ship(None, final=True)

    def _write(self, db: Session, held: lifecycle.Held, *, metrics: bool = True, final: bool = False) -> None:
        """This attempt's new output, metric points, what the watch found and the metric caps kept out, resume
        step and progress (the job's row last: its lock is held only for the end of the transaction)."""
        self.logs.write(db)
        if metrics:
            self.metrics.write(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank)
        self.watch.write(db, node_rank=self.node_rank)
        self._note_caps(db, final=final)
        now = self._shipping = (progress(self.spec, self.metrics), self.metrics.resumed_from_step)
        (shipped_progress, shipped_resume), (progress_now, resumed) = self._shipped, now
        if resumed is not None and resumed != shipped_resume:
            records.record_resume(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank,
                                  step=resumed)
        # Every node's local rank 0 reports its own series; node 0's is the job's, and its progress once it has
        # reported. Another node's moves progress only when it is ahead: a user's script that reports on global
        # rank 0 alone (RANK == 0) reports from whichever node c10d gave that rank.
        if progress_now != shipped_progress and (not self.gang or self.metrics.last_step > held.progress_step
                                                 or (self.node_rank == 0 and self.metrics.last_step > 0)):
            records.record_progress(db, job_id=self.job_id, attempt=self.attempt, progress=progress_now)

    def _note_due(self, *, final: bool) -> bool:
        note, (noted, at) = self.metrics.note(), self._noted
        return note is not None and note != noted and (final or time.monotonic() - at >= NOTE_EVERY_S)

    def _note_caps(self, db: Session, *, final: bool) -> None:
        """What the metric caps kept out of the database, as a warning on the job: every NOTE_EVERY_S while it
        changes, and at the end (counted up to the batch before this one: committed counts only)."""
        if not self._note_due(final=final):
            return
        note = self.metrics.note()
        records.set_warning(db, job_id=self.job_id, warning={"kind": "metrics_capped", "message": note,
                                                             "attempt": self.attempt, "node_rank": self.node_rank})
        self._noted = (note, time.monotonic())
