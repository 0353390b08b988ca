"""Launch torchrun for one attempt and watch it: ship output and metrics, honour cancel and timeout (the watch
on its progress, stragglers and devices is worker/watch.py's)."""

import enum
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, is_refusal
from service.jobs import lifecycle, records
from service.metrics import service as metrics_service
from service.packages.service import package_file
from service.scheduling import placement
from service.settings import Settings
from trainjobs import paths, runenv
from trainjobs.spec import JobSpec, read_requirements, requirement_problem
from trainjobs.states import ErrorType, JobStatus
from worker import devices, environments, launch, packages, processes, sandbox, store_sync
from worker.inventory import free_bytes
from worker.lease import Lease
from worker.root_cause import disk_full, root_cause
from worker.shipping import LogShipper, MetricCaps, MetricTail, OutputPump, sanitized_note
from worker.watch import Watch

log = logging.getLogger(__name__)
PREEMPT_RESEND_S = 1.0  # how often a preemption request is repeated to the ranks until they act on it
DRAIN_FIRST_S, DRAIN_MAX_S = 0.2, 3.0  # after the ranks end, retry shipping from every 0.2 s up to every 3 s
DRAIN_REFUSALS = 3  # a commit refused (not an outage) this many times is not retried again
PIPE_WAIT_S = 5.0  # once the attempt's processes are gone, how long its output pipe may stay open
NOTE_EVERY_S = 5.0  # how often the job's note of what the metric caps kept out is updated while it runs


class Shipped(enum.Enum):
    STORED = "stored"  # or the attempt is no longer ours: nothing more to store
    UNREACHABLE = "unreachable"  # the database is down or out of reach: try again, nothing is lost
    REFUSED = "refused"  # the database answered with an error (a bug, or data it will not take)


@dataclass
class Outcome:
    status: JobStatus
    exit_code: int | None = None
    summary: dict | None = None
    error: dict | None = None
    killed_pids: list[int] = field(default_factory=list)
    detail: str | None = None  # for the job's event log (e.g. why it was handed back)


class Launcher:
    """torchrun's pid, found once under the process launched (a sandbox's bwrap stands between them)."""

    def __init__(self, root_pid: int):
        self.root_pid, self._pid = root_pid, None

    @property
    def pid(self) -> int:
        if self._pid is None:
            found = processes.launcher_pid(self.root_pid)
            try:
                if found == self.root_pid and not processes.is_torchrun(psutil.Process(found)):
                    return found  # not started yet: ask again next time
            except psutil.NoSuchProcess:
                return found
            self._pid = found
        return self._pid


class Supervisor:
    """One attempt of one job on this node (of its gang), from launch to the last process gone."""

    def __init__(self, *, sessions: sessionmaker[Session], settings: Settings, job_id: str, attempt: int,
                 spec: JobSpec, run_dir: Path, gang: launch.Gang | None = None, share: dict | None = None):
        self.sessions, self.settings, self.spec = sessions, settings, spec
        self.share = share  # its devices on a shared worker (worker/devices.py share), or None: the whole worker
        self.job_id, self.attempt, self.run_dir, self.gang = job_id, attempt, run_dir, gang
        self.node_rank = gang.node_rank if gang else 0
        self.tag = launch.run_tag(job_id, attempt, self.node_rank)
        self.metrics = MetricTail(run_dir / runenv.METRICS_FILE, MetricCaps.of(settings))
        self._noted: tuple[str | None, float] = (None, -float("inf"))  # the metric caps' note as last stored, when
        self.cancel_requested = False
        # Renewed on a thread of its own from run()'s start to its end, never by shipping (worker/lease.py).
        self.lease = Lease(sessions, settings, job_id=job_id, attempt=attempt, node_rank=self.node_rank)
        self._refused = 0  # shipping transactions the database refused in a row
        self._removed_checkpoints: list[str] = []  # half-written ones, once the ranks were gone
        self._disk_short = False  # its storage or run dir was below worker_min_free_bytes when the ranks ended
        self.preempt_requests = 0  # the worker is shutting down: 1 = checkpoint and hand back, 2 = stop now
        self.preempted_by: str | None = None  # or the scheduler asked for it (a higher-priority job): who, and why
        self._preempt_since: float | None = None
        self._preempt_sent = -float("inf")
        self.watch = Watch(spec=spec, settings=settings, job_id=job_id, attempt=attempt, metrics=self.metrics)

    @property
    def lease_lost(self) -> bool:
        """The sweeper (or a cancel) gave the job away: stop, write nothing more."""
        return self.lease.lost

    def run(self) -> Outcome:
        self.lease.start()
        try:
            return self._run()
        finally:
            self.lease.stop()

    def _run(self) -> Outcome:
        scripts_dir = self.settings.resolved_scripts_dir
        try:
            if (code_dir := self._unpack_package()) is not None:  # the job's own folder: its script, its cwd
                scripts_dir = code_dir
            entry_script = launch.check_entrypoint(self.spec, allowed=self.settings.allow_entrypoints,
                                                   scripts_dir=scripts_dir)
            requirements = self._requirements(code_dir)
            init_from = self._init_from()
        except launch.EntrypointRefused as exc:  # before anything starts: the job fails, the worker goes on
            return Outcome(JobStatus.FAILED, error={"type": exc.kind, "message": exc.message, "rank": None})
        except packages.PackageUnavailable as exc:
            return Outcome(JobStatus.FAILED, error={"type": ErrorType.PACKAGE_UNAVAILABLE, "message": str(exc),
                                                    "rank": None})
        except packages.UnsafeArchive as exc:
            return Outcome(JobStatus.FAILED, error={"type": ErrorType.UNSAFE_PACKAGE, "rank": None,
                                                    "message": f"the worker refused the job's package: {exc}"})
        except environments.RequirementsFailed as exc:
            return Outcome(JobStatus.FAILED, error={"type": ErrorType.REQUIREMENTS_FAILED, "message": str(exc),
                                                    "rank": None})
        job_dir = paths.job_dir(self.settings.resolved_storage_dir, self.job_id)
        with self.sessions() as db:
            self.logs = LogShipper(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank,
                                   max_bytes=self.settings.log_max_bytes)
            # What earlier attempts used of the job's metric caps.
            self.metrics.names, self.metrics.points = metrics_service.stored(db, job_id=self.job_id,
                                                                             node_rank=self.node_rank)
        env = sync = None
        try:
            if requirements:
                try:
                    env = self._build_env(requirements)
                except (environments.RequirementsFailed, environments.BuildStopped) as exc:
                    self.logs.stage(f"[trainjobs] requirements: {exc}\n".encode(), final=True)
                    self._drain(None)
                    if isinstance(exc, environments.BuildStopped):
                        return self._outcome(None, self._stop_reason(), [])
                    return Outcome(JobStatus.FAILED, error={"type": ErrorType.REQUIREMENTS_FAILED, "rank": None,
                                                            "message": str(exc)})
            # --- object storage (issue 31, worker/store_sync.py): no-op without TRAINJOBS_STORAGE_URL ---
            sync = store_sync.for_attempt(self.settings, job_id=self.job_id, job_dir=job_dir, spec=self.spec,
                                          node_rank=self.node_rank, gang=self.gang is not None,
                                          stale=lambda: self.lease_lost or self.lease.expired)
            if error := sync.restore():  # the store's newest checkpoint, where this machine lacks it
                return Outcome(JobStatus.FAILED, error=error)
            sync.start()  # uploads each new complete checkpoint while the ranks train
            outcome = self._launch(job_dir=job_dir, code_dir=code_dir, scripts_dir=scripts_dir,
                                   entry_script=entry_script, python=env.python if env else sys.executable,
                                   init_from=init_from)
            if error := sync.finish(succeeded=outcome.status is JobStatus.SUCCEEDED):  # last checkpoint, artifacts
                outcome = Outcome(JobStatus.FAILED, outcome.exit_code, error=error)
            # --- end of object storage ---
            return outcome
        finally:
            if env is not None:
                env.release()
            if sync is not None:
                sync.close()
            shutil.rmtree(self.run_dir / "code", ignore_errors=True)  # the package's copy: outputs go to artifacts

    def _launch(self, *, job_dir: Path, code_dir: Path | None, scripts_dir: Path, entry_script: Path | None,
                python: str, init_from: Path | None) -> Outcome:
        plan = launch.render(
            self.spec, job_id=self.job_id, attempt=self.attempt, run_dir=self.run_dir, python=python,
            data_dir=self.settings.data_dir, job_dir=job_dir,
            shutdown_grace_s=self.settings.cancel_grace_s,
            base_env=self._base_env(), cpu_count=len(self._cores()) or os.cpu_count() or 1,
            scripts_dir=scripts_dir, entry_script=entry_script, gang=self.gang, init_from=init_from,
        )
        for folder in (paths.CHECKPOINTS, paths.ARTIFACTS):  # a user's script may write straight into them
            (job_dir / folder).mkdir(parents=True, exist_ok=True)
        (job_dir / "OWNER").write_text(str(self.attempt))  # a stale attempt's ranks then write no checkpoint
        (self.run_dir / "tmp").mkdir(parents=True, exist_ok=True)
        support = sandbox.for_worker(self.settings)
        box = sandbox.Box(support, self.settings, sandbox.Attempt(
            job_id=self.job_id, run_dir=self.run_dir, job_dir=job_dir, python=python, data_dir=self.settings.data_dir,
            scripts_dir=scripts_dir, cwd=code_dir or self.run_dir, init_from=init_from, gang=self.gang is not None,
            node_rank=self.node_rank,
            devices=self._device_nodes()), memory_bytes=self._memory_bytes())
        argv, env = box.wrap(plan.argv, plan.env)
        cores = self._cores()
        self.logs.stage(self._placed(box, cores).encode())
        processes.become_subreaper()
        procs = processes.AttemptProcesses(self.tag)  # before torchrun: what exists now is not the attempt's

        def preexec() -> None:
            processes.prepare_torchrun()
            box.preexec()
            if cores:  # every process of the attempt inherits it
                os.sched_setaffinity(0, cores)

        # A session of its own, so a signal to the worker's terminal never reaches the ranks directly.
        try:
            proc = subprocess.Popen(
                argv, env=env, cwd=code_dir or self.run_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec, umask=box.umask,
            )
        except BaseException:
            box.close()
            raise
        procs.root_pid = proc.pid
        launcher = Launcher(proc.pid)
        pump = OutputPump(proc.stdout.fileno())
        self.watch.launched()
        try:
            moved = self.gang is not None  # a gang turned running when it formed (worker/gang.py)
            with self.sessions() as db:
                moved = moved or lifecycle.start_running(db, job_id=self.job_id, attempt=self.attempt,
                                                         detail=f"torchrun pid {proc.pid}")
                db.commit()
            stop_reason = None if moved else "lost"
            started = time.monotonic()
            killed: list[int] = []
            while True:
                exit_code = proc.poll()
                self._ship(pump)
                if exit_code is not None:
                    break
                if stop_reason is None:
                    if self.lease_lost:
                        stop_reason = "lost"
                    elif self.lease.expired:  # cut off from the database past the lease
                        log.error("job %s: its lease ran out %.1fs ago unrenewed; stopping its ranks", self.job_id,
                                  time.monotonic() - self.lease.ends)
                        stop_reason = "lease_expired"
                    elif self.cancel_requested:
                        stop_reason = "cancelled"
                    elif time.monotonic() - started > self.spec.timeout_s:
                        stop_reason = "timeout"
                    elif self._preempt_past_grace(launcher.pid):
                        stop_reason = "preempted"
                    else:
                        stop_reason = self.watch.poll(launcher.pid)
                    if stop_reason is None and self.watch.pending:  # a dump or a warning: stored now
                        self._ship(None)
                if stop_reason is not None:
                    if stop_reason not in ("lost", "lease_expired"):
                        self._ship(pump)
                    # stop() blocks through the grace period: the lease thread renews meanwhile, so a slow-dying
                    # cancel is not settled as a lost worker.
                    self.lease.tick(busy_s=self.settings.cancel_grace_s + 2)
                    killed = procs.stop(self.settings.cancel_grace_s)
                    exit_code = proc.wait()
                    break
                time.sleep(self.settings.poll_s)
            if left := procs.find():  # torchrun is gone: ranks or their helpers outlived it
                log.warning("attempt %s: %d process(es) outlived torchrun; stopping them", self.tag, len(left))
                killed += procs.stop(min(1.0, self.settings.cancel_grace_s))
            self._disk_short = any((free := free_bytes(d)) is not None and free < self.settings.worker_min_free_bytes
                                   for d in (job_dir, self.run_dir))
            self._removed_checkpoints = self._remove_partial_checkpoints(job_dir)
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

    def _base_env(self) -> dict[str, str]:
        env = sandbox.job_env(self.settings)
        if self.share is not None and self.share.get("kind") == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.share["visible"]  # by UUID: its cuda:0 is its first own GPU
        return env

    def _cores(self) -> list[int]:
        """The cores its ranks are pinned to: its share's (a CPU job's slots, a GPU job's NUMA nodes), or none."""
        return list(self.share.get("cores") or []) if self.share is not None else []

    def _device_nodes(self) -> tuple[str, ...]:
        """The GPU device nodes its sandbox binds: its own GPUs' where they can be told apart, else every one."""
        if self.spec.resources.device == "cpu":
            return ()
        if self.share is not None and self.share.get("uuids"):
            own = devices.gpu_device_nodes(self.share["uuids"])
            if own is not None:
                return (*own, *(n for n in sandbox.gpu_nodes() if not n.removeprefix("/dev/nvidia").isdigit()))
        return sandbox.gpu_nodes()

    def _memory_bytes(self) -> int:
        """Its host-memory bound: on a shared worker, its devices' share of what the worker gives jobs."""
        total = sandbox.default_memory_bytes()
        if self.share is None or not self.share.get("of"):
            return total
        return max(2**28, total * len(self.share["devices"]) // self.share["of"])

    def _placed(self, box: sandbox.Box, cores: list[int]) -> str:
        """The log's first line: where the attempt runs and what bounds it (or that nothing does)."""
        where = f"[trainjobs] attempt {self.attempt} on {self.share['worker'] if self.share else 'its worker'}"
        if self.share is not None:
            noun = "GPU" if self.share.get("kind") == "cuda" else "slot"
            where += f": {noun}(s) {','.join(map(str, self.share['devices']))}"
            if self.share.get("uuids"):
                where += f" ({','.join(self.share['uuids'])})"
        if cores:
            where += f", cores {placement.cpulist(cores)}"
        if box.cgroup is not None:
            where += f", memory bound {box.memory_bytes / 2**30:.1f} GiB ({box.cgroup.version} cgroup)"
        else:
            where += ", no memory bound (this worker cannot make cgroups)"
        return where + "\n"

    def _init_from(self) -> Path | None:
        """spec.init_from's weights as they are now (the latest checkpoint at this launch); None without one."""
        if self.spec.init_from is None:
            return None
        source = paths.init_source(self.settings.resolved_storage_dir, self.spec.init_from.job,
                                   self.spec.init_from.checkpoint)
        if source is None:
            raise launch.EntrypointRefused(ErrorType.INIT_FROM_UNAVAILABLE, f"init_from: job "
                                           f"{self.spec.init_from.job} has no {self.spec.init_from.checkpoint} "
                                           "weights any more (deleted, or collected by retention)")
        return source

    def _requirements(self, code_dir: Path | None) -> list[str]:
        """The job's requirement lines: the spec's list, or read from the file it names in the package."""
        entrypoint = self.spec.entrypoint
        if entrypoint is None or not entrypoint.requirements:
            return []
        if not self.settings.allow_pip:
            raise launch.EntrypointRefused(ErrorType.ENTRYPOINT_DISABLED, "this worker does not install a job's "
                                           "requirements; start it with TRAINJOBS_ALLOW_PIP=1 to allow them")
        if isinstance(entrypoint.requirements, list):
            return entrypoint.requirements
        name = entrypoint.requirements
        path = (code_dir / name).resolve() if code_dir is not None else None
        if path is None or not path.is_relative_to(code_dir.resolve()) or not path.is_file():
            raise environments.RequirementsFailed(f"entrypoint.requirements names {name!r}, which is not a file "
                                                  "in the job's package")
        lines = read_requirements(path.read_text(errors="replace"))
        for number, line in enumerate(lines, 1):
            if problem := requirement_problem(line):
                raise environments.RequirementsFailed(f"{name}: requirement {number} {line!r}: {problem}")
        return lines

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
                             base_env=launch.default_env())

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

    def _unpack_package(self) -> Path | None:
        """The attempt's own copy of the job's package (from this machine's cache), or None without one.

        Only on a worker that runs users' code at all: elsewhere check_entrypoint refuses the job first."""
        entrypoint = self.spec.entrypoint
        if entrypoint is None or entrypoint.package is None or not self.settings.allow_entrypoints:
            return None
        cache = packages.PackageCache(self.settings.data_dir / "package-cache",
                                      max_bytes=self.settings.package_cache_bytes,
                                      max_files=self.settings.max_package_files,
                                      max_unpacked_bytes=self.settings.max_package_unpacked_bytes)
        code_dir = self.run_dir / "code"
        packages.materialize(cache, digest=entrypoint.package, dest=code_dir,
                             archive=package_file(self.settings.resolved_storage_dir, entrypoint.package))
        return code_dir

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
        """Move new output and metrics to the database, and take in what the lease's last renewal read.

        The lease is not renewed here (worker/lease.py renews it on its own thread). Fenced (lifecycle.still_held):
        once the sweeper has given the job to a new attempt (this worker was paused or cut off past its lease),
        nothing more is written for this one. What fails to commit is sent again by the next call: nothing is
        dropped, but for a metric batch the database refuses on its own (shipped apart: _ship_apart).
        """
        self.lease.tick()
        self._take_held()
        if pump is not None and (output := pump.take()):
            self.logs.stage(output)
            self.watch.output_seen()
        try:
            shipped = self._commit(lambda db, held: self._write(db, held, final=final)) if not self._refused else \
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
            self._refused = 0
            return shipped
        self._refused += 1
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
        return Shipped.STORED

    def _take_held(self) -> None:
        """What the lease's last renewal read of the job: a cancel, a preemption, a request for stacks."""
        held = self.lease.held
        if held is None:
            return
        # A sweep's early stop that comes once the ranks reached their last step stops nothing: they end as they
        # would (their model and summary written), and the trial succeeds.
        self.cancel_requested = held.cancel_requested and not (held.stopped_early and self._work_done())
        if held.preempt_detail and self.preempted_by is None:
            self.preempted_by = held.preempt_detail
            self.preempt_requests = max(self.preempt_requests, 1)
        self.watch.stacks_requested(held.stacks_requested_at)

    def _drain(self, pump: OutputPump | None) -> None:
        """The ranks are gone: ship until all they wrote is stored, however long the database is out of reach.

        The outcome is recorded after this, as late as it must be (agent.with_retries): a run that finished
        during an outage is finished, with all its output, metrics and summary, once the database is back.
        Data the database keeps refusing (not an outage: it would be refused forever) is given up, and logged.
        """
        wait, refused = DRAIN_FIRST_S, 0
        while (shipped := self._ship(pump, final=True)) is not Shipped.STORED or (self.metrics.more
                                                                                 and not self.lease_lost):
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
            self._ship(None, final=True)

    def _write(self, db: Session, held: lifecycle.Held, *, metrics: bool = True, final: bool = False) -> None:
        """This attempt's new output, metric points, what the watch found and the metric caps kept out, resume
        step and progress (the job's row last: its lock is held only for the end of the transaction)."""
        self.logs.write(db)
        if metrics:
            self.metrics.write(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank)
        self.watch.write(db, node_rank=self.node_rank)
        self._note_caps(db, final=final)
        if self.metrics.resumed_from_step is not None:
            records.record_resume(db, job_id=self.job_id, attempt=self.attempt, node_rank=self.node_rank,
                                    step=self.metrics.resumed_from_step)
        # Every node's local rank 0 reports its own series; node 0's is the job's, and its progress once it has
        # reported. Another node's moves progress only when it is ahead: a user's script that reports on global
        # rank 0 alone (RANK == 0) reports from whichever node c10d gave that rank.
        if (self.gang is None or self.metrics.last_step > held.progress_step
                or (self.node_rank == 0 and self.metrics.last_step > 0)):
            records.record_progress(db, job_id=self.job_id, attempt=self.attempt, progress=self._progress())

    def _note_caps(self, db: Session, *, final: bool) -> None:
        """What the metric caps kept out of the database, as a warning on the job: every NOTE_EVERY_S while it
        changes, and at the end (counted up to the batch before this one: committed counts only)."""
        note, (noted, at) = self.metrics.note(), self._noted
        if note is None or note == noted or (not final and time.monotonic() - at < NOTE_EVERY_S):
            return
        records.set_warning(db, job_id=self.job_id, warning={"kind": "metrics_capped", "message": note,
                                                             "attempt": self.attempt, "node_rank": self.node_rank})
        self._noted = (note, time.monotonic())

    def _work_done(self) -> bool:
        """The ranks reported their last step (the spec's max_steps; a script's own total_steps, counted from 0 or
        1): what is left is writing out, not work to stop."""
        total = self.metrics.total_steps if self.spec.entrypoint else self.spec.train.max_steps
        return bool(total) and self.metrics.last_step >= total - 1

    def _progress(self) -> dict:
        # An entrypoint's total is what its script reported (report(total_steps=...)), if anything.
        total = self.metrics.total_steps if self.spec.entrypoint else self.spec.train.max_steps
        step, step_time_s = self.metrics.last_step, self.metrics.last_step_time_s
        eta = max(0.0, (total - step) * step_time_s) if total and step_time_s else None
        # NOTE: a script's absurd step times can overflow it, and strict JSON (PostgreSQL's) has no infinity.
        return {"step": step, "total_steps": total, "eta_s": eta if eta is None or math.isfinite(eta) else None}

    def _outcome(self, exit_code: int | None, stop_reason: str | None, killed: list[int]) -> Outcome:
        if stop_reason == "cancelled":
            # A sweep's early stop read before the last steps were (a trial of seconds: its stop raced its end), yet
            # the ranks ended on their own with their summary: the work is done, and a finished trial is kept.
            held = self.lease.held
            if (held is not None and held.stopped_early and exit_code == 0 and self._work_done()
                    and self.metrics.summary is not None):
                return Outcome(JobStatus.SUCCEEDED, exit_code, summary=self.metrics.summary)
            return Outcome(JobStatus.CANCELLED, exit_code, killed_pids=killed)
        if stop_reason == "timeout":
            error = {"type": ErrorType.TIMEOUT, "message": f"job ran past timeout_s={self.spec.timeout_s:g}",
                     "rank": None, "exit_code": exit_code}
            return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)
        if stop_reason == "hung":
            error = {"type": ErrorType.HANG, "message": self.watch.hang_message, "rank": None,
                     "exit_code": exit_code, "final": self.watch.hang_action == "fail"}
            return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)
        if stop_reason == "idle":  # idle.action fail: retrying would idle again
            error = {"type": ErrorType.IDLE, "message": self.watch.idle_message, "rank": None,
                     "exit_code": exit_code, "final": True}
            return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)
        if stop_reason == "lost":
            error = {"type": ErrorType.ATTEMPT_LOST, "message": "another attempt or a cancel took the job",
                     "rank": None, "exit_code": exit_code}
            return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)
        if stop_reason == "lease_expired":  # as the sweeper would say it: a lost worker, retried at once
            error = {"type": ErrorType.WORKER_LOST, "rank": None, "exit_code": exit_code, "node_rank": self.node_rank,
                     "message": f"the worker could not renew its lease for over lease_s={self.settings.lease_s:g}s "
                                "(the database was out of reach); its ranks were stopped"}
            return Outcome(JobStatus.FAILED, exit_code, error=error, killed_pids=killed)
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
        return Outcome(JobStatus.FAILED, exit_code, error=self._disk_full(error) or error)

    def _remove_partial_checkpoints(self, job_dir: Path) -> list[str]:
        """The built-in runtime's checkpoints this attempt left half-written (no COMPLETE: never loaded), removed
        once its ranks are gone, so that a disk they filled has its space back before the outcome is written (on
        `trainjobs up` the database shares that disk). Not a gang's (another node may still be writing the same
        folder), nor a user's own script's: its folders are its own."""
        if self.gang is not None or self.spec.entrypoint is not None:
            return []
        removed = []
        for folder in paths.partial_checkpoints(job_dir):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
        return removed

    def _disk_full(self, error: dict) -> dict | None:
        """A failure that was a write out of space: disk_full, naming the disk (and the checkpoint it left
        half-written, removed). Retried, on a worker with space: this one takes no job while under pressure
        (worker/inventory.py DiskWatch)."""
        job_dir = paths.job_dir(self.settings.resolved_storage_dir, self.job_id)
        full = disk_full(error, dirs=[job_dir, self.run_dir], min_free=self.settings.worker_min_free_bytes,
                         was_short=self._disk_short)
        if full is None:
            return None
        if self._removed_checkpoints:
            full["message"] += f"; its partial checkpoint {', '.join(self._removed_checkpoints)} was removed"
        log.error("job %s: %s", self.job_id, full["message"])
        return full
