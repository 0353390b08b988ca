"""Stage 5, ship: the attempt's new output, metric points and what its watch found, sent as batches through the
worker protocol's `ship` (service/runners/ship_calls.py: in-process for a worker holding the database's URL, over
HTTP for a joined one) while it runs and until all of it is stored once its ranks are gone."""

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.runners.points import PointColumns
from trainjobs.spec import JobSpec
from worker.control import Control, Refused, Revoked, Unreachable
from worker.lease import Lease
from worker.shipping import LogShipper, MetricTail, OutputPump
from worker.watch import Watch

log = logging.getLogger(__name__)
DRAIN_FIRST_S, DRAIN_MAX_S = 0.2, 3.0  # after the ranks end, retry shipping from every 0.2 s up to every 3 s
DRAIN_REFUSALS = 3  # a batch refused (not an outage) this many times is not retried again
NOTE_EVERY_S = 5.0  # how often the job's note of what the metric caps kept out is updated while it runs


class Shipped(enum.Enum):
    STORED = "stored"  # or the attempt is no longer ours: nothing more to store
    UNREACHABLE = "unreachable"  # the control plane is down or out of reach: try again, nothing is lost
    REFUSED = "refused"  # the control plane refused the batch (a bug, or data the database will not take)


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


@dataclass(frozen=True)
class Batch:
    """A batch built for `ship`: sent again as it is (same seq, same content) until it is acknowledged."""

    body: dict
    logs: bool  # it holds the log, the watch's findings, the caps' note, progress: those move on once it is stored
    metrics: bool  # it holds the metric points
    shipping: tuple[dict | None, int | None]  # the progress and resume step as it ships them
    note: str | None  # the metric caps' note it carries


class Shipper:
    """Ships one node's attempt through the worker protocol (worker/control.py); `take_held` reads what the lease's
    last renewal found (a cancel, a preemption) before each ship. The lease is renewed on its own thread
    (worker/lease.py), never here."""

    def __init__(self, *, control: Control, spec: JobSpec, job_id: str, attempt: int, node_rank: int, gang: bool,
                 lease: Lease, metrics: MetricTail, watch: Watch, take_held: Callable[[], None]):
        self.control, self.spec, self.job_id, self.attempt = control, spec, job_id, attempt
        self.node_rank, self.gang, self.lease, self.metrics, self.watch = node_rank, gang, lease, metrics, watch
        self.take_held = take_held
        self.logs: LogShipper | None = None  # set by open() (it starts where the node's stored log ends)
        self.seq = 0  # the last batch's number (open() reads the last one applied)
        self.event_seq = 0  # the attempt's job events' last number (worker/store_sync.py event_writer)
        self.refused = 0  # batches refused in a row
        self._noted: tuple[str | None, float] = (None, -float("inf"))  # the metric caps' note as last stored, when
        # The progress and resume step as last shipped (written, or left as the job's by a gang's rule): each is
        # sent only when it changed, so the job's row (and its ETag) moves only when the job does.
        self._shipped: tuple[dict | None, int | None] = (None, None)
        self._batch: Batch | None = None  # sent, not acknowledged (the control plane out of reach): sent again
        self._away_since: float | None = None  # the control plane out of reach since (logged once an outage)

    def ref(self) -> dict:
        return {"job_id": self.job_id, "attempt": self.attempt, "node_rank": self.node_rank}

    def open(self, *, max_bytes: int) -> None:
        """Read what the shippers start from (the protocol's `open`): the node's stored log, what earlier attempts
        used of the job's metric caps, the last numbers applied. Retried while the control plane is out of reach
        and the lease may still hold; past it, the attempt cannot start (RuntimeError: the agent records it)."""
        wait = DRAIN_FIRST_S
        while True:
            try:
                opened = self.control.call("open", self.ref())
                break
            except Unreachable as exc:
                if self.lease.lost or self.lease.expired:
                    raise RuntimeError(f"the control plane stayed out of reach at the attempt's start: {exc}") from exc
                log.warning("job %s: the control plane is out of reach (%s); opening the attempt will retry",
                            self.job_id, exc)
                self.lease.tick()
                time.sleep(wait)
                wait = min(DRAIN_MAX_S, wait * 2)
        self.logs = LogShipper(job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank, max_bytes=max_bytes,
                               offset=opened["log_bytes"], seq=opened["log_seq"])
        self.metrics.names, self.metrics.points = set(opened["metric_names"]), opened["metric_points"]
        self.seq, self.event_seq = opened["seq"], opened["event_seq"]

    def ship(self, pump: OutputPump | None, *, final: bool = False) -> Shipped:
        """Send new output and metrics as a batch, and take in what the lease's last renewal read.

        Fenced by the control plane: once the sweeper has given the job to a new attempt (this worker was paused or
        cut off past its lease), nothing more is written for this one, and the answer says it is lost. A batch not
        acknowledged (UNREACHABLE) is sent again, as it was, by the next call, before anything new: the control
        plane applies it once. Nothing is dropped, but for a metric batch refused on its own (ship_apart). A ship
        with nothing new sends nothing at all: the lease, renewed on its own, is what says the worker is alive (and
        finds a lost job). A final one (the drain's, once per attempt) always does: the ranks are gone, and the
        drain waits to see the control plane take their last output, however long it is away.
        """
        self.lease.tick()
        self.take_held()
        if pump is not None and (output := pump.take()):
            self.logs.stage(output)
            self.watch.output_seen()
        try:
            shipped = self._exchange(final=final)
            if self._away_since is not None:
                log.info("job %s: the control plane answers again: shipping resumed after %.1fs", self.job_id,
                         time.monotonic() - self._away_since)
                self._away_since = None
            return shipped
        except Unreachable as exc:
            if self._away_since is None:
                log.warning("job %s: the control plane is out of reach (%s); shipping will retry", self.job_id, exc)
                self._away_since = time.monotonic()
            return Shipped.UNREACHABLE
        except Revoked as exc:  # the machine's credential revoked: the API took its jobs back
            log.error("job %s: the API refused this machine's credential (%s): nothing more is shipped", self.job_id,
                      exc)
            self.lease.lost = True
            return Shipped.STORED
        except Refused as exc:
            log.error("job %s: the control plane refused a batch (HTTP %s: %s); will ship apart", self.job_id,
                      exc.status, exc.detail[:2000])
        except Exception:  # noqa: BLE001 - a database blip must never kill a healthy run
            log.exception("shipping for job %s failed; will retry apart", self.job_id)
        self._batch = None  # nothing of a refused batch was stored: what it held goes again (apart)
        self.refused += 1
        return Shipped.REFUSED

    def _exchange(self, *, final: bool) -> Shipped:
        """The batch not acknowledged yet, first; then (a final ship always) the next one, if anything is new."""
        if self._batch is not None:
            self._send(self._batch)
            if not final or self.lease.lost:
                return Shipped.STORED
        points = self.metrics.stage()  # the next metric batch, read before anything is sent
        if not final and not self._news(points=points):
            self.metrics.committed()  # what it read held no point to store (a summary, thinned steps): read
            return Shipped.STORED
        if self.refused:
            self._ship_apart(final=final)
        else:
            self._send(self._build(final=final))
        self.refused = 0
        return Shipped.STORED

    def _ship_apart(self, *, final: bool) -> None:
        """After a refused batch: the log and the watch's findings in one batch, the metrics in another; a metric
        batch refused on its own is given up (counted in the job's note, logged), so one bad batch never holds back
        the log, nor every batch after it."""
        self._send(self._build(final=final, metrics=False))
        if self.lease.lost:
            return
        try:
            self._send(self._build(final=final, logs=False))
            return
        except (Unreachable, Revoked):
            raise
        except Exception as exc:  # noqa: BLE001 - data the control plane will not take: given up below
            refused = exc
        log.error("job %s: the control plane refused a batch of its metrics on its own (%s); giving it up",
                  self.job_id, str(refused)[:2000])
        self._batch = None
        self.metrics.give_up()

    def _build(self, *, final: bool, logs: bool = True, metrics: bool = True) -> Batch:
        """The next batch, numbered: the new output, what the watch found, the caps' note when due, the resume
        step and progress when they changed (`logs`); the metric points staged (`metrics`)."""
        self.seq += 1
        body = {**self.ref(), "seq": self.seq, "gang": self.gang, "final": final}
        shipping, note = self._shipped, None
        if logs:
            if (part := self.logs.part()) is not None:
                body["log"] = part
            body |= self.watch.part()
            if self._note_due(final=final):
                body["caps_note"] = note = self.metrics.note()
            shipping = (progress(self.spec, self.metrics), self.metrics.resumed_from_step)
            if shipping[1] is not None and shipping[1] != self._shipped[1]:
                body["resumed_from_step"] = shipping[1]
            if shipping[0] != self._shipped[0]:
                body["progress"] = shipping[0]
        if metrics:
            body["points"] = PointColumns.of(self.metrics.part()).model_dump()
        return Batch(body, logs=logs, metrics=metrics, shipping=shipping, note=note)

    def _send(self, batch: Batch) -> None:
        """`ship` the batch; once acknowledged (applied now or before), the shippers of what it held move on. An
        answer that the attempt lost its job stores nothing more: the lease says so to the supervisor."""
        self._batch = batch
        answer = self.control.call("ship", batch.body)
        self._batch = None
        if answer["lost"]:
            self.lease.lost = True
            return
        if batch.metrics:
            self.metrics.committed()
        if batch.logs:
            self.logs.committed()
            self.watch.committed()
            self._shipped = batch.shipping
            if batch.note is not None:
                self._noted = (batch.note, time.monotonic())

    def _news(self, *, points: int) -> bool:
        """Whether this ship has anything to send: points, output, the watch's findings, a changed progress or
        resume step, or a metric caps' note that is due."""
        watch = self.watch
        return bool(points or self.logs.news or watch.warnings_pending or watch.stacks_pending is not None
                    or watch.samples_pending or self._note_due(final=False)
                    or (progress(self.spec, self.metrics), self.metrics.resumed_from_step) != self._shipped)

    def drain(self, pump: OutputPump | None) -> None:
        """The ranks are gone: ship until all they wrote is stored, however long the control plane is out of reach.

        The outcome is recorded after this, as late as it must be (agent.with_retries): a run that finished
        during an outage is finished, with all its output, metrics and summary, once the control plane is back.
        Data it keeps refusing (not an outage: it would be refused forever) is given up, and logged.
        """
        wait, refused = DRAIN_FIRST_S, 0
        while (shipped := self.ship(pump, final=True)) is not Shipped.STORED or (
                (self.metrics.more or self.logs.news) and not self.lease.lost):
            if shipped is Shipped.STORED:  # a backlog (metrics, or output past one batch): the next batch at once
                continue
            refused += shipped is Shipped.REFUSED
            if refused >= DRAIN_REFUSALS:
                log.error("job %s: the control plane refused the attempt's last output %d times; giving it up",
                          self.job_id, refused)
                return
            time.sleep(wait)
            wait = min(DRAIN_MAX_S, wait * 2)
        if self.metrics.note() != self._noted[0] and not self.lease.lost:  # the last batch's counts: in the note too
            self.ship(None, final=True)

    def _note_due(self, *, final: bool) -> bool:
        note, (noted, at) = self.metrics.note(), self._noted
        return note is not None and note != noted and (final or time.monotonic() - at >= NOTE_EVERY_S)
