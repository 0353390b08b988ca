"""Each rank's own share of a step, for naming stragglers without a collective per step.

Under DDP or FSDP every rank's step takes as long as the slowest rank's, since backward waits for the gradient
sync: the step time alone cannot say who is slow. What a rank spends before its backward (its data and its
forward) is its own, so that is what is timed (on CUDA with events, read once per window: no sync per step),
then gathered once per log window (one small all_gather) and reported by global rank 0 as
step_time_s/rank<r>: the supervisor names a rank that stays well above the others (worker/supervisor.py).
"""

import contextlib
import time

import torch
import torch.distributed as dist

SERIES = "step_time_s/rank"  # + the global rank: a metric per rank


class OwnTime:
    def __init__(self, device: torch.device, *, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.device, self.enabled = device, enabled  # spec.straggler.enabled: off, nothing is timed or gathered
        self.seconds, self._events = 0.0, []

    @contextlib.contextmanager
    def measure(self):
        if not self.enabled:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began

    def take(self) -> float:
        """Seconds measured since the last take (on CUDA, waits for the window's last event only)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def gather(self, steps: int) -> list[float]:
        """Every rank's own time per step over the window (a collective: every rank calls it, on log steps)."""
        mine = torch.tensor([self.take() / max(1, steps)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return [t.item() for t in every]
