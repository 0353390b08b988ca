"""Ranks agree to stop at one step: the all-reduce that both stop paths share.

A stop request reaches each rank on its own (a signal handler sets a flag), and ranks that stopped at different
steps would hang in the next gradient all-reduce. So, after every step, each rank calls `due` with its own request,
and the ranks all-reduce (MAX) the requests: one signalled rank is enough, and every rank learns it at the same step.
Used by the built-in runtime (worker/train/preempt.py) and by zero-code capture's stop for framework scripts
(trainjobs/capture/stop.py).

The public package never imports torch (DESIGN.md layers): Agreement() uses the torch the rank has loaded already
(sys.modules), as trainjobs/capture/stop.py does.

NOTE: on 2 gloo CPU ranks sharing 2 cores (a 1.5-2.6 ms step of a small MLP), a blocking 1-element all-reduce
after every step cost 0.7-1.7 ms (+40-65%), far from the ~100 us it takes on an idle machine; one started async and
read a step later still ~0.3 ms (+10%). So the all-reduce is started asynchronously at one check and read at the
next, and checks are `interval` steps apart, sized to about CHECK_EVERY_S of training (~60 steps there; 1 for steps
over 0.1 s): lost in the noise (<3%), and a stop within ~2 * CHECK_EVERY_S plus a step (measured: 0.24 s to the
saved checkpoint). The interval travels in the same all-reduce (MAX), so the ranks agree on it as on the request.
"""

import sys
import time
from typing import Any

CHECK_EVERY_S = 0.1  # about this much training between two agreement checks
MAX_INTERVAL = 1000  # steps


class Agreement:
    """Make on every rank at the same point, with the default process group up (a collective: it makes a group)."""

    def __init__(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None:
            raise RuntimeError("Agreement is made in a rank with torch loaded and its process group up")
        dist = torch.distributed
        self._dist = dist
        # NOTE: a gloo group of its own, on CPU tensors: on CUDA the flag never forces a device sync, and its
        # all-reduce never queues behind (or between) the model's gradient collectives.
        self._group = dist.new_group(backend="gloo")
        self._buf = torch.zeros(2, dtype=torch.int64)  # [the largest request of any rank, next interval in steps]
        self._work: Any = None
        self._next_check, self._last_step, self._last_time = 1, 0, time.perf_counter()

    def due(self, step: int, requested: int) -> int:
        """After step `step`, this rank asking `requested` (0: nothing; a larger number outranks a smaller): the
        request every rank agreed on now, or 0 to go on. The same answer on every rank (a collective, called by all
        after every step)."""
        if step < self._next_check:
            return 0
        interval = 1
        if self._work is not None:
            self._work.wait()
            self._work = None
            if agreed := int(self._buf[0].item()):
                return agreed
            interval = int(self._buf[1].item())
        now = time.perf_counter()
        step_s = (now - self._last_time) / max(1, step - self._last_step)
        self._last_step, self._last_time = step, now
        self._buf[0] = requested
        self._buf[1] = max(1, min(MAX_INTERVAL, int(CHECK_EVERY_S / max(step_s, 1e-9))))
        self._work = self._dist.all_reduce(self._buf, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._next_check = step + interval
        return 0

    def close(self) -> None:
        """Wait for the last all-reduce (every rank started it), so the process group can be destroyed."""
        if self._work is not None:
            self._work.wait()
            self._work = None
