"""What a rank of a user's job cannot reach: the environment of the processes above it (service/undumpable.py).

The kernel's rule is checked as a user other than root (root reads any process's /proc): with setpriv as
`nobody` when the tests run as root, which needs a Python that `nobody` may run (the system's).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent
SECRET_URL = "postgresql+psycopg://trainjobs:s3cret-pw@db:5432/trainjobs"

# A worker (which holds the database URL) forks a work-horse, which starts a rank with a clean environment
# (as torchrun does); the rank tries to read both ancestors' environments.
CHAIN = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "hardened":
    from service.undumpable import make_undumpable
    assert make_undumpable()
RANK = '''
import json, sys
seen = {}
for pid in sys.argv[1:]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            seen[pid] = "s3cret-pw" in f.read().decode()
    except OSError as exc:
        seen[pid] = exc.strerror
print(json.dumps(seen))
'''
worker = os.getpid()
horse = os.fork()
if horse == 0:
    out = subprocess.run([sys.executable, "-c", RANK, str(worker), str(os.getpid())], env={"PATH": "/usr/bin"},
                         capture_output=True, text=True).stdout
    print(json.dumps({"worker": json.loads(out)[str(worker)], "horse": json.loads(out)[str(os.getpid())]}))
    sys.stdout.flush()
    os._exit(0)
os.waitpid(horse, 0)
"""


def run_as_another_user(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    if os.getuid() != 0:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if not setpriv or not os.access(python, os.X_OK):
        pytest.skip("running as root without setpriv and a system python: cannot check as another user")
    return subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, *argv[1:]],
                          env=env, capture_output=True, text=True, timeout=60, cwd="/")


@pytest.mark.parametrize("mode", ["hardened", "plain"])
def test_a_rank_cannot_read_the_environment_of_the_worker_and_horse_above_it(mode):
    out = run_as_another_user([sys.executable, "-c", CHAIN, str(ROOT), mode],
                              env={"PATH": "/usr/bin:/bin", "TRAINJOBS_DATABASE_URL": SECRET_URL})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    if mode == "hardened":
        assert seen == {"worker": "Permission denied", "horse": "Permission denied"}
    else:  # the control: without the flag the same uid reads the URL, which is what the worker used to allow
        assert seen == {"worker": True, "horse": True}


PROBE = "import ctypes; {start}; print('dumpable', ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"


@pytest.mark.parametrize("process", ["worker", "api"])
def test_the_worker_and_the_api_make_themselves_undumpable(process, postgres_url, redis, tmp_path):
    start = {"worker": "import worker.main; worker.main.main(burst=True)", "api": "import service.api.asgi"}[process]
    env = dict(os.environ, TRAINJOBS_DATABASE_URL=postgres_url, TRAINJOBS_REDIS_URL=REDIS_URL,
               TRAINJOBS_DATA_DIR=str(tmp_path / "data"), TRAINJOBS_QUEUE_PREFIX=f"dump{os.getpid()}",
               TRAINJOBS_WORKER_SLOTS="1", TRAINJOBS_WORKER_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", PROBE.format(start=start)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "dumpable 0" in out.stdout
