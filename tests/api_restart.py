"""A live stack's API process (tests/helpers.py live_stack) killed as a crash kills it, and started again."""

import signal
import time

from service.cli.stack import Stack


def restart_api(stack: Stack, *, down_s: float = 0.0) -> None:
    """SIGKILL the stack's API (no shutdown of any kind: connections cut, requests in flight unanswered), leave it
    down `down_s`, then start it again on the same port with the same command line, and wait until it is ready."""
    [(i, proc)] = [(i, proc) for i, (name, proc) in enumerate(stack.procs) if name == "api"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    del stack.procs[i]  # (check_alive would take the dead one for a crash of the stack)
    time.sleep(down_s)
    stack._spawn("api", list(proc.args))
    stack._wait_ready()
