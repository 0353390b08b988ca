"""Another user's job, running while tests/hostile/hostile.py attacks it: a checkpoint, an artifact, then it
waits (up to 120 s) for the test to drop a `stop` file in its checkpoint dir, and checks nothing was planted."""

import os
import time
from pathlib import Path

checkpoints = Path(os.environ["TRAINJOBS_CHECKPOINT_DIR"])
(checkpoints / "model.pt").write_bytes(b"victim weights")
Path(os.environ["TRAINJOBS_ARTIFACTS_DIR"], "report.txt").write_text("victim's own")
print("victim ready", flush=True)
deadline = time.monotonic() + 120
while not (checkpoints / "stop").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print("victim sees", sorted(p.name for p in checkpoints.iterdir()), flush=True)
