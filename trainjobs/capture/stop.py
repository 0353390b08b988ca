"""Stop on SIGTERM or PREEMPT_SIGNAL at a step every rank agrees on: how HF's Trainer saves before the grace ends.

Two requests come to a user's ranks: SIGTERM (a cancel, a timeout, and today the worker's hand-back of an
entrypoint job: then SIGKILL after TRAINJOBS_CANCEL_GRACE_S) and PREEMPT_SIGNAL (SIGUSR1: "checkpoint and exit",
what the supervisor sends the built-in runtime's ranks on a hand-back; the rank then reports `preempted` and the job
goes back to the queue without spending a retry). A rank only sets a flag in the handler. Ranks that stopped at
different steps would hang in the next gradient all-reduce, so, as the built-in runtime does
(worker/train/preempt.py), the ranks all-reduce (MAX) the flag: started asynchronously at one check and read at the
next, checks about CHECK_EVERY_S of training apart, so no step waits on it. torch is never imported here: the
framework's, from sys.modules.
"""

import signal
import sys
import threading
import time
from typing import Any

from trainjobs.runenv import PREEMPT_SIGNAL

CHECK_EVERY_S = 0.1
MAX_INTERVAL = 1000  # steps


class StopOnSignal:
    """Install on every rank at the same point (a collective: it makes a gloo group when there are several)."""

    def __init__(self) -> None:
        self.requested = 0  # 1: SIGTERM came; 2: PREEMPT_SIGNAL came (on this rank)
        self.preempt = False  # the agreed stop is a preemption (some rank got PREEMPT_SIGNAL)
        self.handling = False
        self._previous: dict[int, Any] = {}
        self._dist: Any = None
        self._group = self._buf = self._work = None
        self._next_check, self._last_step, self._last_time = 1, 0, time.perf_counter()

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, PREEMPT_SIGNAL)) -> bool:
        """Handle `signals`, but those the script handles itself (its handlers stay)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        # NOTE: the worker starts torchrun with PREEMPT_SIGNAL ignored (worker/processes.py), until a rank handles it.
        free = {signal.SIGTERM: (signal.SIG_DFL, None), PREEMPT_SIGNAL: (signal.SIG_DFL, signal.SIG_IGN, None)}
        ours = [sig for sig in signals if signal.getsignal(sig) in free[sig]]
        if not ours:
            return False
        # NOTE: the torch the framework loaded, never imported here: the public package stays torch-free
        # (DESIGN.md layers), and a framework whose hooks run has torch in sys.modules already.
        torch, dist = sys.modules.get("torch"), sys.modules.get("torch.distributed")
        if (torch is not None and dist is not None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            self._dist = dist
            # NOTE: a gloo group of its own, on CPU tensors: on CUDA the flag never forces a device sync.
            self._group = dist.new_group(backend="gloo")
            self._buf = torch.zeros(2, dtype=torch.int64)  # [requested on any rank, next interval in steps]
        for sig in ours:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        self.handling = True
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        # NOTE: a rank gets SIGTERM twice (the worker's, then torchrun's forward): the second changes nothing.
        self.requested = max(self.requested, 2 if signum == PREEMPT_SIGNAL else 1)

    def due(self, step: int) -> bool:
        """After step `step`: stop now? The same answer on every rank (every rank calls it after every step)."""
        if not self.handling:
            return False
        if self._dist is None:
            self.preempt = self.requested == 2
            return bool(self.requested)
        if step < self._next_check:
            return False
        interval = 1
        if self._work is not None:
            self._work.wait()
            self._work = None
            if agreed := self._buf[0].item():
                self.preempt = agreed == 2
                return True
            interval = int(self._buf[1].item())
        now = time.perf_counter()
        step_s = (now - self._last_time) / max(1, step - self._last_step)
        self._last_step, self._last_time = step, now
        self._buf[0] = self.requested
        self._buf[1] = max(1, min(MAX_INTERVAL, int(CHECK_EVERY_S / max(step_s, 1e-9))))
        self._work = self._dist.all_reduce(self._buf, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._next_check = step + interval
        return False

    def close(self) -> None:
        """Wait for the last all-reduce (every rank started it); give SIGTERM back its default unless it came (then
        the script's last lines run on until the worker's grace ends, not cut by torchrun's second SIGTERM)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self.handling and not self.requested and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
        self.handling = False
