"""What the supervisor watches in a running attempt besides its lifetime: hangs (with every rank's stack), the
stacks a user asks for, stragglers, and idle devices (from the usage it samples: worker/usage.py). Called once
per poll; what it finds goes in the attempt's next batch (part, then committed once stored, as the log and the
metrics do)."""

import collections
import logging
import statistics
import time
from datetime import datetime

from service.runners.ship_calls import SAMPLES_MAX, WARNINGS_MAX
from service.settings import Settings
from trainjobs.spec import JobSpec
from worker import stacks, usage
from worker.shipping import MetricTail

log = logging.getLogger(__name__)
CPU_SERIES = "cpu_util/rank"  # + the global rank: percent of one core, the rank and its own children


class Watch:
    """Hang detection, stacks on request, stragglers and idle devices for one attempt on this node."""

    def __init__(self, *, spec: JobSpec, settings: Settings, job_id: str, attempt: int, metrics: MetricTail):
        self.settings, self.job_id, self.attempt, self.metrics = settings, job_id, attempt, metrics
        # Hang detection (spec.hang, else the settings): when the job last showed progress, and how long a step takes.
        hang = spec.hang
        self.hang_min_s = hang.min_s if hang.min_s is not None else settings.hang_min_s
        self.hang_factor = hang.factor if hang.factor is not None else settings.hang_factor
        self.hang_startup_s = hang.startup_s if hang.startup_s is not None else settings.hang_startup_s
        self.hang_action = hang.action or settings.hang_action
        self.hang_on = hang.enabled
        self._reports_steps = spec.entrypoint is None  # built-in: its first step (or resume) ends the startup
        self._resumed_seen = False
        self.hang_message: str | None = None
        self._hang_reported = False
        self._active_at = self._launched_at = time.monotonic()  # a new step (or, before the first, new output)
        self._output_at = -float("inf")
        self._step_seen = 0
        self._step_times: collections.deque[float] = collections.deque(maxlen=64)
        self.stacks_pending: dict | None = None  # a dump not yet stored on the attempt
        self._stacks_asked: datetime | None = None  # the job's stacks_requested_at, as last read
        self._stacks_served: datetime | None = None
        self._stacks_read = False  # a request older than this attempt's first renewal is not for it
        self.straggler_on = spec.straggler.enabled
        self.straggler_factor = spec.straggler.factor or settings.straggler_factor
        self.straggler_windows = spec.straggler.windows or settings.straggler_windows
        self._slow_windows: dict[int, int] = {}  # rank -> log windows in a row it was slow
        self._stragglers: set[int] = set()  # named once per attempt
        self.warnings_pending: list[dict] = []
        # Usage and idleness (spec.idle, else the settings): sampled every usage_sample_s from outside the ranks.
        idle = spec.idle
        self.sample_s = settings.usage_sample_s if idle.enabled else 0.0
        self.idle_min_util = idle.min_util if idle.min_util is not None else settings.idle_min_util
        self.idle_window_s = idle.window_s if idle.window_s is not None else settings.idle_window_s
        self.idle_action = idle.action or settings.idle_action
        self.idle_message: str | None = None
        self._sampled_at = self._busy_at = time.monotonic()
        self._gpus = usage.GpuReader(usage.job_gpus(spec.resources.nproc_per_node)) \
            if self.sample_s and spec.resources.device != "cpu" else None
        if self._gpus is not None and self._gpus.source is None:  # "auto" on a machine without a GPU: its CPUs
            self._gpus = None
        self._cpu = usage.RankCpu()
        self.samples_pending: list[tuple[int, str, float, float]] = []  # (step, name, value, unix time)
        self._written: tuple[dict | None, int, int] = (None, 0, 0)  # what the last part() holds

    def launched(self) -> None:
        """The ranks start now: an environment build before it was no part of the run."""
        self._active_at = self._launched_at = self._busy_at = time.monotonic()

    def output_seen(self) -> None:
        self._output_at = time.monotonic()

    def stacks_requested(self, requested_at: datetime | None) -> None:
        """The job's stacks_requested_at, as the lease renewal read it."""
        self._stacks_asked = requested_at
        if not self._stacks_read:
            self._stacks_served, self._stacks_read = requested_at, True

    @property
    def pending(self) -> bool:
        """Something to store now (a dump, a warning), not at the next poll."""
        return self.stacks_pending is not None or bool(self.warnings_pending)

    def poll(self, torchrun_pid: int) -> str | None:
        """Once per poll while the ranks run: "hung" or "idle" when they must be stopped, else None."""
        hung = self._watch_hang(torchrun_pid)
        if self.straggler_on:
            self._watch_stragglers()
        idle = self._watch_usage(torchrun_pid) if self.sample_s else False
        return "hung" if hung else "idle" if idle else None

    def close(self) -> None:
        if self._gpus is not None:
            self._gpus.close()

    def _watch_hang(self, torchrun_pid: int) -> bool:
        """Hang detection, and the stacks a user asked for; True when the ranks are hung and must stop.

        Progress is a new step; before a job's first step (a script that reports nothing), new output. No progress
        for max(min_s, factor × the median step time) is a hang (before the first step or the resume from a
        checkpoint, while the ranks import and meet, at least startup_s; for a script of a user's own, until its
        first output or step): every rank's stack
        is taken (worker/stacks.py) and stored on the attempt, then hang.action applies (report: an event, once per
        hang, and go on).
        """
        now = time.monotonic()
        if self.metrics.last_step != self._step_seen:
            self._step_seen, self._active_at, self._hang_reported = self.metrics.last_step, now, False
            if self.metrics.last_step_time_s:
                self._step_times.append(self.metrics.last_step_time_s)
        elif self._step_seen == 0 and self._output_at > self._active_at:
            self._active_at, self._hang_reported = self._output_at, False
        if self.metrics.resumed_from_step is not None and not self._resumed_seen:  # set up: its checkpoint loaded
            self._resumed_seen, self._active_at = True, now
        if self._stacks_asked is not None and self._stacks_asked != self._stacks_served:
            self._stacks_served = self._stacks_asked
            self.stacks_pending = {**stacks.dump(torchrun_pid, reason="requested"),
                                   "requested_at": self._stacks_asked.isoformat()}
        silent = now - self._active_at
        bound = max(self.hang_min_s, self.hang_factor * statistics.median(self._step_times)
                    if self._step_times else 0.0)
        set_up = self._step_seen or self._resumed_seen
        if not set_up and (self._reports_steps or self._output_at < self._launched_at):
            bound = max(bound, self.hang_startup_s)
        if silent < bound or self._hang_reported or not self.hang_on:
            return False
        dump = stacks.dump(torchrun_pid, reason="hang")
        what = f"no new step for {silent:.0f}s after step {self._step_seen}" if self._step_seen else \
            f"no step reported and no output for {silent:.0f}s"
        self.hang_message = f"hung: {what} (bound {bound:.0f}s): {stacks.summary(dump)}"
        self.stacks_pending = {**dump, "message": self.hang_message}
        log.error("job %s: %s; action %s", self.job_id, self.hang_message, self.hang_action)
        if self.hang_action == "report":
            self._hang_reported = True
            return False
        return True

    def _watch_stragglers(self) -> None:
        """Name a rank whose own step time stays at least `factor` × the median of the others' (and a few ms above
        it) for `windows` log windows in a row: an event and a warning on the job, once per rank per attempt."""
        while self.metrics.rank_windows:
            window = self.metrics.rank_windows.pop(0)
            for rank, own in window.items():
                others = statistics.median(v for r, v in window.items() if r != rank) if len(window) > 1 else own
                slow = own >= self.straggler_factor * others and own - others >= self.settings.straggler_min_excess_s
                self._slow_windows[rank] = self._slow_windows.get(rank, 0) + 1 if slow else 0
                if self._slow_windows[rank] >= self.straggler_windows and rank not in self._stragglers:
                    self._stragglers.add(rank)
                    message = (f"rank {rank} is a straggler: its own step time (data and forward) was "
                               f"{own * 1000:.1f} ms, {own / others if others else float('inf'):.1f}x the median of "
                               f"the other ranks ({others * 1000:.1f} ms) for {self._slow_windows[rank]} log "
                               f"windows in a row (attempt {self.attempt})")
                    log.warning("job %s: %s", self.job_id, message)
                    self.warnings_pending.append({"kind": "straggler", "rank": rank, "attempt": self.attempt,
                                                  "message": message})

    def _watch_usage(self, torchrun_pid: int) -> bool:
        """Sample the job's GPUs (or each rank's CPU) every sample_s into its usage series; True when it has been
        idle for the window and idle.action is fail. Idle: every device (every rank) below min_util, at every
        sample since the window began (the launch, or the last sample that was not idle)."""
        now = time.monotonic()
        if now - self._sampled_at < self.sample_s:
            return False
        self._sampled_at = now
        step, at = self.metrics.last_step, time.time()
        if self._gpus is not None:
            gpus = self._gpus.read()
            if not gpus:
                return False
            utils = [g.util for g in gpus]
            self.samples_pending += [(step, "gpu_util", sum(utils) / len(utils), at),
                                     (step, "gpu_mem", sum(g.mem_bytes for g in gpus) / 2**20, at)]
            what = f"the job's GPUs ({', '.join(f'{u:.0f}%' for u in utils)} at the last sample)"
        else:
            ranks = self._cpu.read(torchrun_pid)
            if not ranks:  # the first sample is the baseline of the next
                return False
            utils = list(ranks.values())
            self.samples_pending += [(step, f"{CPU_SERIES}{rank}", value, at) for rank, value in ranks.items()]
            what = "every rank's CPU use (" + ", ".join(f"rank {r}: {v:.1f}%" for r, v in ranks.items()) + \
                " at the last sample)"
        if max(utils) >= self.idle_min_util:
            self._busy_at = now
        if self.idle_message is not None or now - self._busy_at < self.idle_window_s:
            return False
        self.idle_message = (f"{what} stayed below idle.min_util={self.idle_min_util:g}% for "
                             f"{now - self._busy_at:.0f}s (idle.window_s={self.idle_window_s:g}, attempt "
                             f"{self.attempt})")
        log.warning("job %s: %s; action %s", self.job_id, self.idle_message, self.idle_action)
        self.warnings_pending.append({"kind": "idle", "rank": None, "attempt": self.attempt,
                                      "message": self.idle_message})
        return self.idle_action == "fail"

    def part(self) -> dict:
        """The pending warnings, dump and usage samples as a batch carries them (service/runners/ship_calls.py; each
        list cut to its bound, the rest for the next batch); they stay pending until committed()."""
        warnings, samples = self.warnings_pending[:WARNINGS_MAX], self.samples_pending[:SAMPLES_MAX]
        self._written = (self.stacks_pending, len(warnings), len(samples))
        return {**({"warnings": warnings} if warnings else {}), **({"samples": samples} if samples else {}),
                **({"stacks": self.stacks_pending} if self.stacks_pending is not None else {})}

    def committed(self) -> None:
        """What the last part() held is stored: drop it (what came since stays for the next)."""
        written, warned, sampled = self._written
        if written is not None and written is self.stacks_pending:
            self.stacks_pending = None
        del self.warnings_pending[:warned]
        del self.samples_pending[:sampled]
        self._written = (None, 0, 0)
