"""Loaded by every Python process started with this folder on PYTHONPATH (tests/test_layout.py).

A training rank leaves through os._exit (worker/train/distributed.py), past atexit: wrap it, so a rank
writes the names of every module it had loaded, after training, to $TRAINJOBS_TEST_MODULES_OUT.<rank>.
"""

import os
import sys

_exit = os._exit


def _write_modules_then_exit(code: int) -> None:
    out, rank = os.environ.get("TRAINJOBS_TEST_MODULES_OUT"), os.environ.get("RANK")
    if out and rank is not None:
        with open(f"{out}.{rank}", "w") as f:
            f.write("\n".join(sorted(sys.modules)))
    _exit(code)


os._exit = _write_modules_then_exit
