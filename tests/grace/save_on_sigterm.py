"""A user's script that saves on SIGTERM, as a Lightning or HF Trainer save-on-signal does: each rank writes
saved-rank<RANK> into the job's artifacts, then exits."""

import os
import signal
import sys
import time
from pathlib import Path


def save(signum, frame):
    time.sleep(0.5)  # a save takes a moment: the grace must cover it
    rank = os.environ["RANK"]
    out = Path(os.environ["TRAINJOBS_ARTIFACTS_DIR"]) / f"saved-rank{rank}-attempt{os.environ['TRAINJOBS_ATTEMPT']}"
    out.write_text(signal.Signals(signum).name)
    print(f"rank {rank}: saved on {signal.Signals(signum).name}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, save)
print(f"rank {os.environ['RANK']}: ready", flush=True)
while True:
    time.sleep(0.1)
