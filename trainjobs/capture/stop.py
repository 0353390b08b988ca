"""Stop on SIGTERM or PREEMPT_SIGNAL at a step every rank agrees on: how HF's Trainer saves before the grace ends.

Two requests come to a user's ranks: SIGTERM (a cancel, a timeout, and the worker's hand-back of an entrypoint job:
then SIGKILL after TRAINJOBS_CANCEL_GRACE_S) and PREEMPT_SIGNAL (SIGUSR1: "checkpoint and exit", what the supervisor
sends the built-in runtime's ranks on a hand-back; the rank then reports `preempted` and the job goes back to the
queue without spending a retry). A rank only sets a flag in the handler. Ranks that stopped at different steps would
hang in the next gradient all-reduce, so, as the built-in runtime does, the ranks agree on the step through
trainjobs/agreement.py (an all-reduce started at one check and read at the next, no step waits on it). torch is
never imported here: Agreement is made only where the framework's torch.distributed is up, from sys.modules.
"""

import signal
import sys
import threading
from typing import Any

from trainjobs.agreement import Agreement
from trainjobs.runenv import PREEMPT_SIGNAL


class StopOnSignal:
    """Install on every rank at the same point (a collective: it makes a gloo group when there are several)."""

    def __init__(self) -> None:
        self.requested = 0  # 1: SIGTERM came; 2: PREEMPT_SIGNAL came (on this rank)
        self.preempt = False  # the agreed stop is a preemption (some rank got PREEMPT_SIGNAL)
        self.handling = False
        self._previous: dict[int, Any] = {}
        self._agreement: Agreement | None = None  # with several ranks

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, PREEMPT_SIGNAL), *, replacing: tuple = ()) -> bool:
        """Handle `signals`, but those the script handles itself (its handlers stay; those in `replacing` do not)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        # NOTE: the worker starts torchrun with PREEMPT_SIGNAL ignored (worker/processes.py), until a rank handles it.
        free = {signal.SIGTERM: (signal.SIG_DFL, None), PREEMPT_SIGNAL: (signal.SIG_DFL, signal.SIG_IGN, None)}
        ours = [sig for sig in signals if signal.getsignal(sig) in (*free[sig], *replacing)]
        if not ours:
            return False
        # NOTE: the torch the framework loaded, never imported here: a script with no process group needs none.
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._agreement = Agreement()
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
        if self._agreement is None:
            self.preempt = self.requested == 2
            return bool(self.requested)
        if agreed := self._agreement.due(step, self.requested):
            self.preempt = agreed == 2
        return bool(agreed)

    def close(self) -> None:
        """Wait for the last all-reduce (every rank started it); give SIGTERM back its default unless it came (then
        the script's last lines run on until the worker's grace ends, not cut by torchrun's second SIGTERM)."""
        if self._agreement is not None:
            self._agreement.close()
        if self.handling and not self.requested and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
        self.handling = False
