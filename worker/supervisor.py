"""One attempt of one job on this node, its stages read top to bottom (worker/attempt/): place → prepare its code,
dirs and environment → sandbox → launch → watch and ship; then what its end means for the job."""

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service import jobfiles
from service.settings import Settings
from trainjobs import paths, runenv
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType, JobStatus
from worker import control as worker_control
from worker import devices, environments, launch, processes, store_sync
from worker.attempt import outcome, prepare, start
from worker.attempt.outcome import Outcome
from worker.attempt.place import Placed
from worker.attempt.ship import Shipped, Shipper, work_done
from worker.attempt.start import Launcher
from worker.inventory import free_bytes
from worker.lease import Lease
from worker.root_cause import root_cause
from worker.shipping import LogShipper, MetricCaps, MetricTail, OutputPump, sanitized_note
from worker.watch import Watch

__all__ = ["Launcher", "Outcome", "Shipped", "Supervisor"]
log = logging.getLogger(__name__)
PREEMPT_RESEND_S = 1.0  # how often a preemption request is repeated to the ranks until they act on it
PIPE_WAIT_S = 5.0  # once the attempt's processes are gone, how long its output pipe may stay open


class Supervisor:
    """One attempt of one job on this node (of its gang), from launch to the last process gone."""

    def __init__(self, *, sessions: sessionmaker[Session], settings: Settings, job_id: str, attempt: int,
                 spec: JobSpec, run_dir: Path, gang: launch.Gang | None = None, share: dict | None = None,
                 control: worker_control.Control | None = None):
        self.sessions, self.settings, self.spec = sessions, settings, spec
        # How it reaches the control plane (worker/control.py): the API where the worker joined one, else the
        # database; the protocol's calls are the same either way.
        self.control = control or worker_control.for_worker(settings, sessions)
        self.placed = Placed.of(share, spec)  # its devices on a shared worker, or the whole worker
        self.job_id, self.attempt, self.run_dir, self.gang = job_id, attempt, run_dir, gang
        self.node_rank = gang.node_rank if gang else 0
        self.tag = launch.run_tag(job_id, attempt, self.node_rank)
        self.metrics = MetricTail(run_dir / runenv.METRICS_FILE, MetricCaps.of(settings))
        self.cancel_requested = False
        # Renewed on a thread of its own from run()'s start to its end, never by shipping (worker/lease.py).
        self.lease = Lease(self.control, settings, job_id=job_id, attempt=attempt, node_rank=self.node_rank)
        self._removed_checkpoints: list[str] = []  # half-written ones, once the ranks were gone
        self._disk_short = False  # its storage or run dir was below worker_min_free_bytes when the ranks ended
        self.preempt_requests = 0  # the worker is shutting down: 1 = checkpoint and hand back, 2 = stop now
        self.preempted_by: str | None = None  # or the scheduler asked for it (a higher-priority job): who, and why
        self._preempt_since: float | None = None
        self._preempt_sent = -float("inf")
        self.watch = Watch(spec=spec, settings=settings, job_id=job_id, attempt=attempt, metrics=self.metrics)
        self.health = devices.HealthWatch(self.placed.gpus)  # a GPU of its turned bad: stopped, retried elsewhere
        self.shipper = Shipper(control=self.control, spec=spec, job_id=job_id, attempt=attempt,
                               node_rank=self.node_rank, gang=gang is not None, lease=self.lease, metrics=self.metrics,
                               watch=self.watch, take_held=self._take_held)

    @property
    def lease_lost(self) -> bool:
        """The sweeper (or a cancel) gave the job away: stop, write nothing more."""
        return self.lease.lost

    @property
    def logs(self) -> LogShipper:
        return self.shipper.logs

    @logs.setter
    def logs(self, logs: LogShipper) -> None:
        self.shipper.logs = logs

    def run(self) -> Outcome:
        self.lease.start()
        try:
            return self._run()
        finally:
            self.lease.stop()

    def _run(self) -> Outcome:
        try:
            code = prepare.find_code(self.spec, self.settings, self.run_dir, lease=self.lease)
        except prepare.REFUSALS as exc:  # before anything starts: the job fails, the worker goes on
            return Outcome(JobStatus.FAILED, error=prepare.refusal(exc))
        job_dir = paths.job_dir(self.settings.resolved_storage_dir, self.job_id)
        # The node's stored log, and what earlier attempts used of the job's metric caps (the protocol's `open`).
        self.shipper.open(max_bytes=self.settings.log_max_bytes)
        env = sync = None
        try:
            if code.requirements:
                self._phase(f"installing {len(code.requirements)} requirement(s)")
                try:
                    env = self._build_env(code.requirements)
                except (environments.RequirementsFailed, environments.BuildStopped) as exc:
                    self.logs.stage(f"[trainjobs] requirements: {exc}\n".encode(), final=True)
                    self._drain(None)
                    if isinstance(exc, environments.BuildStopped):
                        return self._outcome(None, self._stop_reason(), [])
                    return Outcome(JobStatus.FAILED, error=prepare.refusal(exc))
            # --- object storage (issue 31, worker/store_sync.py): no-op without TRAINJOBS_STORAGE_URL ---
            sync = store_sync.for_attempt(self.settings, job_id=self.job_id, job_dir=job_dir, spec=self.spec,
                                          node_rank=self.node_rank, gang=self.gang is not None,
                                          lease=self.lease,
                                          note=store_sync.event_writer(self.control, **self.shipper.ref(),
                                                                       seq=self.shipper.event_seq))
            if error := sync.restore():  # the store's newest checkpoint, where this machine lacks it
                return Outcome(JobStatus.FAILED, error=error)
            sync.start()  # uploads each new complete checkpoint while the ranks train
            self._phase(f"launching torchrun ({self.spec.resources.nproc_per_node} process(es) on this node)")
            result = self._launch(job_dir=job_dir, code=code, python=env.python if env else sys.executable)
            if error := sync.finish(succeeded=result.status is JobStatus.SUCCEEDED):  # last checkpoint, artifacts
                result = Outcome(JobStatus.FAILED, result.exit_code, error=error)
            # --- end of object storage ---
            return result
        finally:
            if env is not None:
                env.release()
            if sync is not None:
                sync.close()
            shutil.rmtree(self.run_dir / "code", ignore_errors=True)  # the package's copy: outputs go to artifacts

    def _phase(self, phase: str) -> None:
        """What the attempt does before its ranks run, shown as the starting job's pending_reason."""
        try:
            self.control.call("phase", {"job_id": self.job_id, "attempt": self.attempt, "node_rank": self.node_rank,
                                        "phase": phase})
        except (worker_control.Unreachable, worker_control.Refused) as exc:  # only what the job page shows
            log.warning("attempt %s: its phase %r was not written (%s)", self.tag, phase, exc)

    def _running(self, pid: int) -> bool:
        """starting → running (the `running` call); while the control plane does not answer, tried again as long as
        the lease may still hold (the ranks train meanwhile); False once the job moved on, or past the lease."""
        wait = 0.5
        while True:
            try:
                return self.control.call("running", {"job_id": self.job_id, "attempt": self.attempt,
                                                     "detail": f"torchrun pid {pid}"})["running"]
            except worker_control.Unreachable as exc:
                if self.lease.expired or self.lease.lost:
                    return False
                log.warning("attempt %s: the control plane did not take 'running' (%s); again in %.1fs", self.tag,
                            exc, wait)
                self.lease.tick()
                time.sleep(wait)
                wait = min(5.0, wait * 2)

    def _launch(self, *, job_dir: Path, code: prepare.Code, python: str) -> Outcome:
        plan = prepare.render(self.spec, self.settings, job_id=self.job_id, attempt=self.attempt, run_dir=self.run_dir,
                              job_dir=job_dir, python=python, code=code, placed=self.placed, gang=self.gang)
        prepare.make_dirs(job_dir=job_dir, run_dir=self.run_dir, attempt=self.attempt)
        box = start.enclose(self.settings, job_id=self.job_id, run_dir=self.run_dir, job_dir=job_dir, python=python,
                            code=code, placed=self.placed, gang=self.gang)
        try:
            argv, env = box.wrap(plan.argv, plan.env)
        except jobfiles.Refused as exc:  # init_from's weights made a link since prepare checked them
            box.close()
            return Outcome(JobStatus.FAILED, error={"type": ErrorType.INIT_FROM_UNAVAILABLE, "rank": None,
                                                    "message": f"init_from: job {code.init_job}'s {exc}"})
        self.logs.stage(self.placed.describe(self.attempt, box).encode())
        launched = start.launch_attempt(argv, env, cwd=code.code_dir or self.run_dir, box=box,
                                        cores=self.placed.cores, tag=self.tag)
        proc, procs, pump = launched.proc, launched.procs, launched.pump
        self.watch.launched()
        try:
            # A gang turned running when it formed (worker/gang.py).
            moved = self.gang is not None or self._running(proc.pid)
            exit_code, stop_reason, killed = self._watch(launched, None if moved else "lost")
            if left := procs.find():  # torchrun is gone: ranks or their helpers outlived it
                log.warning("attempt %s: %d process(es) outlived torchrun; stopping them", self.tag, len(left))
                killed += procs.stop(min(1.0, self.settings.cancel_grace_s))
            self._disk_short = any((free := free_bytes(d)) is not None and free < self.settings.worker_min_free_bytes
                                   for d in (job_dir, self.run_dir))
            self._removed_checkpoints = outcome.remove_partial_checkpoints(job_dir, spec=self.spec,
                                                                           gang=self.gang is not None)
            # Every process of the attempt is gone, so the pipe closes: shipping (and the lease) go on meanwhile.
            if not pump.wait_closed(PIPE_WAIT_S, self.settings.poll_s, lambda: self._ship(pump)):
                log.error("attempt %s: its output pipe is still open %.0fs after its processes ended; "
                          "not waiting for it", self.tag, PIPE_WAIT_S)
            self.logs.stage(pump.take(), final=True)
            self._drain(pump)
            if note := sanitized_note(self.logs, self.metrics):  # once, after the last metric line was read
                self.logs.stage(note.encode())
                self._drain(pump)
        finally:
            # Whatever happened above, no process of this attempt outlives the supervisor.
            if left := procs.find():
                log.error("attempt %s left %d process(es); killing them", self.tag, len(left))
                procs.stop(0)
            if box.oom_killed():
                self.logs.stage(f"[trainjobs] the attempt reached its memory bound ({box.memory_bytes} bytes, "
                                "TRAINJOBS_JOB_MEMORY_BYTES): the kernel killed a process of it\n".encode(),
                                final=True)
                self._drain(None)
            box.close()
            procs.reap()  # the sandbox's own processes, re-parented to this subreaper when bwrap's first one ended
            proc.stdout.close()
            self.watch.close()
            shutil.rmtree(self.run_dir / "tmp", ignore_errors=True)
        return self._outcome(exit_code, stop_reason, killed)

    def _watch(self, launched: start.Launched, stop_reason: str | None) -> tuple[int, str | None, list[int]]:
        """Ship while torchrun runs; stop its processes once a reason comes (the grace first): its exit code, why
        it was stopped (None: it ended on its own) and the pids that needed SIGKILL."""
        proc, pump, started = launched.proc, launched.pump, time.monotonic()
        while True:
            exit_code = proc.poll()
            self._ship(pump)
            if exit_code is not None:
                return exit_code, stop_reason, []
            if stop_reason is None:
                stop_reason = self._why_stop(launched.launcher, started)
                if stop_reason is None and self.watch.pending:  # a dump or a warning: stored now
                    self._ship(None)
            if stop_reason is not None:
                if stop_reason not in ("lost", "lease_expired"):
                    self._ship(pump)
                # stop() blocks through the grace period: the lease thread renews meanwhile, so a slow-dying
                # cancel is not settled as a lost worker.
                self.lease.tick(busy_s=self.settings.cancel_grace_s + 2)
                killed = launched.procs.stop(self.settings.cancel_grace_s)
                return proc.wait(), stop_reason, killed
            try:  # torchrun's end is seen at once, not up to poll_s late (a short job's wall time showed it)
                proc.wait(timeout=self.settings.poll_s)
            except subprocess.TimeoutExpired:
                pass

    def _why_stop(self, launcher: Launcher, started: float) -> str | None:
        """Why the running attempt must stop now, if it must."""
        if self.lease_lost:
            return "lost"
        if self.lease.expired:  # cut off from the database past the lease
            log.error("job %s: its lease ran out %.1fs ago unrenewed; stopping its ranks", self.job_id,
                      time.monotonic() - self.lease.ends)
            return "lease_expired"
        if self.cancel_requested:
            return "cancelled"
        if time.monotonic() - started > self.spec.timeout_s:
            return "timeout"
        if self._preempt_past_grace(launcher.pid):
            return "preempted"
        if self.health.poll() is not None:
            return "device_unhealthy"
        if self.metrics.refused:
            return "unsafe_file"
        return self.watch.poll(launcher.pid)

    def _build_env(self, requirements: list[str]) -> environments.Env:
        """The job's environment (built, or this machine's, reused), shipping the log and holding the lease
        meanwhile; BuildStopped once the attempt must stop (self._stop_reason() says why)."""
        cache = environments.EnvCache(self.settings.data_dir / "envs", max_bytes=self.settings.env_cache_bytes)
        shipped = time.monotonic()

        def tick() -> bool:
            nonlocal shipped
            if time.monotonic() - shipped >= self.settings.poll_s:
                self._ship(None)
                shipped = time.monotonic()
            return self._stop_reason() is not None

        return cache.acquire(requirements, output=self.logs.stage, tick=tick, timeout_s=self.settings.pip_timeout_s,
                             base_env=launch.default_env(), settings=self.settings, job_id=self.job_id)

    def _stop_reason(self) -> str | None:
        """Why an attempt that has not launched its ranks yet must stop, if it must."""
        if self.lease_lost:
            return "lost"
        if self.lease.expired:
            return "lease_expired"
        if self.cancel_requested:
            return "cancelled"
        if self.preempt_requests:
            return "preempted"
        return None

    def preempt(self) -> None:
        """The worker is shutting down: checkpoint and hand the job back; a second call stops it now.

        Safe in a signal handler: it only counts; the supervision loop acts on it.
        """
        self.preempt_requests += 1

    def _preempt_past_grace(self, torchrun_pid: int) -> bool:
        """Ask the ranks to checkpoint and exit; True (stop hard) past the grace or on a second request."""
        if not self.preempt_requests:
            return False
        now = time.monotonic()
        if self._preempt_since is None:
            self._preempt_since = now
            log.info("job %s: preempted; asking its ranks to checkpoint and exit", self.job_id)
        # A user's script has no handler for the signal: it gets SIGTERM, as on cancel, and may checkpoint then.
        if (self.preempt_requests > 1 or self.spec.entrypoint is not None
                or now - self._preempt_since > self.settings.preempt_grace_s):
            return True
        if now - self._preempt_sent >= PREEMPT_RESEND_S:  # again: a rank still starting up ignores it
            processes.signal_ranks(torchrun_pid, runenv.PREEMPT_SIGNAL)
            self._preempt_sent = now
        return False

    def _ship(self, pump: OutputPump | None, *, final: bool = False) -> Shipped:
        """Move new output and metrics to the database (worker/attempt/ship.py), taking in what the lease read."""
        return self.shipper.ship(pump, final=final)

    def _drain(self, pump: OutputPump | None) -> None:
        """The ranks are gone: ship until all they wrote is stored, however long the database is out of reach."""
        self.shipper.drain(pump)

    def _take_held(self) -> None:
        """What the lease's last renewal read of the job: a cancel, a preemption, a request for stacks."""
        held = self.lease.held
        if held is None:
            return
        # A sweep's early stop that comes once the ranks reached their last step stops nothing: they end as they
        # would (their model and summary written), and the trial succeeds.
        self.cancel_requested = held.cancel_requested and not (held.stopped_early
                                                               and work_done(self.spec, self.metrics))
        if held.preempt_detail and self.preempted_by is None:
            self.preempted_by = held.preempt_detail
            self.preempt_requests = max(self.preempt_requests, 1)
        self.watch.stacks_requested(held.stacks_requested_at)

    def _outcome(self, exit_code: int | None, stop_reason: str | None, killed: list[int]) -> Outcome:
        if stop_reason == "cancelled":
            # A sweep's early stop read before the last steps were (a trial of seconds: its stop raced its end), yet
            # the ranks ended on their own with their summary: the work is done, and a finished trial is kept.
            held = self.lease.held
            if (held is not None and held.stopped_early and exit_code == 0 and work_done(self.spec, self.metrics)
                    and self.metrics.summary is not None):
                return Outcome(JobStatus.SUCCEEDED, exit_code, summary=self.metrics.summary)
            return Outcome(JobStatus.CANCELLED, exit_code, killed_pids=killed)
        if failed := outcome.stopped(stop_reason, exit_code, killed, spec=self.spec, settings=self.settings,
                                     watch=self.watch, node_rank=self.node_rank, device_problem=self.health.problem,
                                     unsafe=self.metrics.refused):
            return failed
        # The ranks checkpointed and stopped on a preemption: this node's, or (the runtime all-reduces the request)
        # another node's of the gang, whose ranks then exit 0 here too. Either way the job is not done.
        step = self.metrics.preempted_at_step
        # The built-in runtime always ends with a summary; a user's script need not report at all.
        # A node of a gang whose ranks do not include global rank 0 has no summary to show (only metrics).
        finished = exit_code == 0 and step is None and (self.metrics.summary is not None
                                                        or self.spec.entrypoint is not None or self.gang is not None)
        # NOTE: whatever else ended it while the worker shuts down (a job that finished in the grace apart),
        # the job goes back to the queue: not failed, no retry spent. A hand-back closes the whole gang.
        if stop_reason == "preempted" or (self.preempt_requests and not finished) or step is not None:
            if self.cancel_requested:  # asked for while the ranks were stopping: the user's word wins
                return Outcome(JobStatus.CANCELLED, exit_code, killed_pids=killed)
            if self.preempted_by:
                detail = f"{self.preempted_by}; " + (f"handed back at step {step}" if step is not None else
                                                     "it resumes from its last checkpoint")
            elif not self.preempt_requests:
                detail = f"handed back with its gang at step {step}: another node's worker is shutting down"
            elif step is not None:
                detail = f"preempted by worker shutdown at step {step}"
            else:
                detail = "preempted by worker shutdown; it resumes from its last checkpoint"
            return Outcome(JobStatus.QUEUED, exit_code, detail=detail, killed_pids=killed)
        if finished:
            return Outcome(JobStatus.SUCCEEDED, exit_code, summary=self.metrics.summary)
        error = root_cause(self.run_dir, exit_code, excerpt=self.logs.recent[-4000:],
                           entrypoint=self.spec.entrypoint is not None, node_rank=self.node_rank,
                           nproc=self.spec.resources.nproc_per_node if self.gang else None)
        job_dir = paths.job_dir(self.settings.resolved_storage_dir, self.job_id)
        full = outcome.out_of_space(error, job_id=self.job_id, dirs=[job_dir, self.run_dir], settings=self.settings,
                                    was_short=self._disk_short, removed=self._removed_checkpoints)
        return Outcome(JobStatus.FAILED, exit_code, error=full or error)
