"""Graceful preemption inside the ranks: PREEMPT_SIGNAL asks them to stop at a step they all agree on.

The supervisor signals each rank (torchrun does not forward SIGUSR1); a rank only sets a flag. After
optimizer steps the ranks all-reduce (MAX) the flag (trainjobs/agreement.py, shared with zero-code capture's
stop for framework scripts), so one signalled rank is enough and every rank learns it at the same step; the
caller then checkpoints there and exits.
"""

import signal

from trainjobs.agreement import Agreement
from trainjobs.runenv import PREEMPT_SIGNAL


class Preemption:
    """Install early (right after init_distributed): until then the signal is ignored, not lost for good."""

    def __init__(self):
        self.requested = False
        signal.signal(PREEMPT_SIGNAL, self._on_signal)
        self._agreement = Agreement()

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def due(self, step: int) -> bool:
        """After optimizer step `step`: stop now? The same answer on every rank (a collective, called by all)."""
        return bool(self._agreement.due(step, int(self.requested)))

    def close(self) -> None:
        """Wait for the last all-reduce (every rank started it), so the process group can be destroyed."""
        self._agreement.close()
