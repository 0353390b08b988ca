"""`trainjobs api --workers N`: the master and every worker hold the database URL in their environment, so none
may be dumpable (service/undumpable.py), and the resource tracker uvicorn's workers share must not hold it: a
process of the same uid (a job's rank, on one machine) reads a dumpable process's /proc/<pid>/environ."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from service import migrate
from tests.conftest import QUEUE_PREFIX, REDIS_URL

# NOTE: root with any capability reads every process's /proc files; root with none at all is a plain uid, which
# may read only the dumpable processes of its own uid. The API and the reader both run so, as a job's rank would
# beside the API. (Not as another uid: the venv's Python may sit in a home only root can enter.)
AS_PLAIN_UID = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
# Prints "<pid> <whether its environment holds the marker>" for each pid whose environ it can read.
READER = """
import sys
for pid in sys.argv[2:]:
    try:
        environ = open(f'/proc/{pid}/environ', 'rb').read()
    except OSError:
        continue
    print(pid, sys.argv[1].encode() in environ)
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or (AS_PLAIN_UID and not shutil.which("setpriv")),
    reason="needs Linux /proc (and setpriv when run as root)")


def readable_environs(pids: list[int], marker: str) -> dict[int, bool]:
    """The pids whose /proc/<pid>/environ a process of the API's uid can read → whether it holds `marker`."""
    out = subprocess.run([*AS_PLAIN_UID, sys.executable, "-c", READER, marker, *map(str, pids)],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {int(pid): holds == "True" for pid, holds in (line.split() for line in out.splitlines())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, api: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert api.poll() is None, f"the API exited: {api.stdout.read()}"
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the API never answered /healthz")


@pytest.fixture
def database_url(tmp_path) -> str:
    (tmp_path / "data").mkdir()
    url = f"sqlite:///{tmp_path / 'data' / 'trainjobs.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def api(database_url, tmp_path):
    """`trainjobs api --workers 2` on a free loopback port, as a plain uid."""
    env = {**os.environ, "TRAINJOBS_DATA_DIR": str(tmp_path / "data"), "TRAINJOBS_DATABASE_URL": database_url,
           "TRAINJOBS_REDIS_URL": REDIS_URL, "TRAINJOBS_QUEUE_PREFIX": QUEUE_PREFIX}
    port = free_port()
    trainjobs = Path(sys.executable).with_name("trainjobs")
    proc = subprocess.Popen([*AS_PLAIN_UID, str(trainjobs), "api", "--port", str(port), "--workers", "2"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_plain_process_of_the_apis_uid_shows_its_environment(database_url):
    """The check below means something: the reader does see a dumpable process's database URL."""
    sleeper = subprocess.Popen([*AS_PLAIN_UID, "sleep", "30"], env={"TRAINJOBS_DATABASE_URL": database_url})
    try:
        time.sleep(0.2)
        assert readable_environs([sleeper.pid], database_url) == {sleeper.pid: True}
    finally:
        sleeper.kill()
        sleeper.wait()


def command_of(proc: psutil.Process) -> list[str]:
    """Its command line, or ["<gone>"] for a child that ended between the listing and the read (a short-lived
    helper of uvicorn's, or of the app's start)."""
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ["<gone>", "resource_tracker"]  # not counted as a server


def test_no_process_of_a_multi_worker_api_shows_the_database_url_to_its_uid(api, database_url):
    master = psutil.Process(api.pid)
    # Each worker turns undumpable as it imports the app, a moment after it starts: poll a while.
    deadline = time.monotonic() + 30
    while True:
        children = master.children(recursive=True)
        readable = readable_environs([master.pid, *(c.pid for c in children)], database_url)
        servers = [c for c in children if "resource_tracker" not in " ".join(command_of(c))]
        done = len(servers) >= 2 and not any(readable.values()) and master.pid not in readable
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(servers) >= 2, f"expected 2 API workers, saw {[command_of(c) for c in children]}"
    shown = {pid: psutil.Process(pid).cmdline() for pid, holds in readable.items() if holds}
    assert shown == {}, "these show the database URL"
    # The master and the workers hold it in memory too (/proc/<pid>/mem): not dumpable at all.
    assert readable.keys().isdisjoint({master.pid, *(s.pid for s in servers)})
