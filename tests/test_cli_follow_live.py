"""`trainjobs run --follow` as a user sees it, in a terminal (a pseudo-terminal, as a shell gives) and in a pipe
(`| tee run.log`): the script's lines and the status changes arrive while the job runs, not in one burst at its
end."""

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.helpers import live_stack, wait_for

# Prints a line at once, then runs until it is cancelled: the line must reach the screen while the job runs.
SLOW_SCRIPT = """\
import time
print("first line from the script", flush=True)
time.sleep(600)
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("follow-live"), name="followlive",
                    allow_entrypoints=True) as stack:
        yield stack


@pytest.fixture
def project(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_SCRIPT)
    return tmp_path


def cli_env(stack, tmp_path) -> dict:
    return {**os.environ, "TRAINJOBS_API_URL": stack.api_url, "TRAINJOBS_TOKEN": stack.token,
            "TRAINJOBS_CONFIG": str(tmp_path / "config.toml"), "COLUMNS": "120", "TERM": "xterm-256color"}


class Screen:
    """What a process has written to `fd` so far, read without blocking the test."""

    def __init__(self, fd: int):
        self.fd, self.text = fd, ""

    def read(self, timeout: float = 0.2) -> str:
        while select.select([self.fd], [], [], timeout)[0]:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the pty's other end closed: the process has ended
                break
            if not data:
                break
            self.text += ANSI.sub("", data.decode(errors="replace"))
            timeout = 0
        return self.text

    def wait_for(self, needle: str, timeout: float) -> str:
        return wait_for(lambda: needle in self.read() and self.text, timeout, interval=0,
                        what=f"{needle!r} on the screen; it shows:\n{self.text}")


def job_status(stack, job_id: str) -> str:
    with stack.client() as api:
        return api.get(f"/v1/jobs/{job_id}").json()["status"]


def follow_until_cancelled(stack, proc: subprocess.Popen, screen: Screen) -> str:
    """The screen once the job's line has shown; checks the job ran then, cancels it, and waits for the end."""
    screen.wait_for("first line from the script", 120)
    job_id = re.search(r"submitted ([0-9a-f]{20})", screen.text)[1]
    assert job_status(stack, job_id) == "running", screen.text  # the line came while the job ran
    shown_while_running = screen.text
    with stack.client() as api:
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        screen.read()
    screen.read()
    assert proc.wait(timeout=5) == 130, screen.text  # cancelled
    assert "cancelled" in screen.text
    return shown_while_running


def test_run_follow_in_a_terminal_shows_the_scripts_line_while_the_job_runs(stack, project):
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "run", "--follow", "--", "slow.py"],
                            cwd=project, env=cli_env(stack, project), stdin=child, stdout=child, stderr=child,
                            start_new_session=True)
    os.close(child)
    try:
        shown = follow_until_cancelled(stack, proc, Screen(main))
    finally:
        proc.kill()
        os.close(main)
    assert "running" in shown  # the bar's status had changed by then


def test_run_follow_in_a_pipe_prints_each_status_and_line_as_it_comes(stack, project):
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "run", "--follow", "--", "slow.py"],
                            cwd=project, env=cli_env(stack, project), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        shown = follow_until_cancelled(stack, proc, Screen(proc.stdout.fileno()))
    finally:
        proc.kill()
        proc.stdout.close()
    # One line per change of status in a pipe, the running one before the script's line.
    assert re.search(r": 0/\? running\n(.*\n)*first line from the script", shown), shown
