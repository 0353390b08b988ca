"""A job that attacks its worker, the service and the other jobs; run as a real job by tests/test_sandbox.py.

`python hostile.py PROBE`: each attempt prints `RESULT <name> allowed|refused <detail>` and the job exits 0
whatever it was refused, so the test reads what the sandbox let through. TARGET (JSON, the spec's env) names
what to aim at: the paths and pids outside that the test knows.
"""

import ctypes
import json
import os
import socket
import sys
import time
from pathlib import Path

TARGET = json.loads(os.environ.get("TARGET", "{}"))


def attempt(name, fn):
    try:
        detail = fn()
        print(f"RESULT {name} allowed {detail!r}", flush=True)
    except BaseException as exc:  # noqa: BLE001 - the refusal is the result
        print(f"RESULT {name} refused {type(exc).__name__}: {exc}", flush=True)


def write(path):
    def go():
        Path(path).write_text("planted by another job")
        return path
    return go


def queue():
    from redis import Redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    urls = {"env": os.environ.get("TRAINJOBS_REDIS_URL") or "redis://127.0.0.1:6379/0", "real": TARGET["redis"]}
    for which, url in urls.items():
        for name in TARGET["queues"]:
            def push(url=url, name=name):
                redis = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
                Queue(name, connection=redis, serializer=JSONSerializer).enqueue_call(
                    "os.system", args=[f"touch {TARGET['proof']}"])
                return url
            attempt(f"push-{which}-{name}", push)


def files():
    attempt("read-secrets", lambda: sorted(os.listdir(TARGET["secrets"])))
    attempt("read-admin-token", lambda: Path(TARGET["secrets"], "admin.token").read_text())
    attempt("read-database", lambda: Path(TARGET["database"]).read_bytes()[:16])

    def insert_admin():
        import sqlite3

        db = sqlite3.connect(TARGET["database"], timeout=2)
        db.execute("INSERT INTO api_tokens (id) VALUES ('evil')")
        db.commit()
    attempt("write-database", insert_admin)
    attempt("read-neighbour-checkpoint", lambda: Path(TARGET["neighbour_checkpoints"], "model.pt").read_bytes())
    attempt("list-neighbour-artifacts", lambda: os.listdir(TARGET["neighbour_artifacts"]))
    attempt("plant-neighbour-checkpoint", write(Path(TARGET["neighbour_checkpoints"], "planted.pt")))
    attempt("list-runs", lambda: os.listdir(TARGET["runs"]))
    attempt("list-package-cache", lambda: os.listdir(TARGET["package_cache"]))
    attempt("write-data-dir", write(Path(TARGET["data_dir"], "planted")))
    attempt("write-scripts", write(Path(TARGET["scripts"], "planted.py")))
    attempt("write-venv", write(Path(sys.prefix, "lib", "planted.py")))
    attempt("write-usr", write("/usr/planted"))
    attempt("write-etc", write("/etc/planted"))
    attempt("write-owner", write(Path(os.environ["TRAINJOBS_CHECKPOINT_DIR"]).parent / "OWNER"))
    attempt("read-worker-home", lambda: os.listdir(TARGET["home"]))
    attempt("own-checkpoint", write(Path(os.environ["TRAINJOBS_CHECKPOINT_DIR"], "mine.pt")))
    attempt("own-artifact", write(Path(os.environ["TRAINJOBS_ARTIFACTS_DIR"], "mine.txt")))
    attempt("own-tmp", write("/tmp/mine"))
    attempt("own-shm", write("/dev/shm/mine"))


def procs():
    pid = TARGET["neighbour_pid"]
    attempt("see-neighbour", lambda: Path(f"/proc/{pid}/cmdline").read_bytes())
    attempt("signal-neighbour", lambda: os.kill(pid, 0))
    libc = ctypes.CDLL(None, use_errno=True)

    def ptrace():
        if libc.ptrace(16, pid, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return pid
    attempt("ptrace-neighbour", ptrace)
    attempt("read-worker-environ", lambda: Path(f"/proc/{TARGET['worker_pid']}/environ").read_bytes())
    attempt("read-pid1-environ", lambda: Path("/proc/1/environ").read_bytes())
    attempt("count-processes", lambda: len([p for p in os.listdir("/proc") if p.isdigit()]))
    attempt("open-standin-gpu", lambda: open(TARGET["device"], "rb").close())
    attempt("open-dev-null", lambda: open("/dev/null", "rb").close())

    def connect():
        with socket.create_connection(("127.0.0.1", TARGET["api_port"]), timeout=2):
            return "connected"
    attempt("reach-api", connect)


def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", TARGET["marker"]])
        os._exit(0)
    os.wait()
    print("RESULT daemon allowed forked", flush=True)


def linger():
    daemon()
    time.sleep(120)


def forkbomb():
    count = 0
    try:
        while count < 100_000:
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)
            count += 1
    except OSError as exc:
        print(f"RESULT forkbomb refused after {count}: {exc}", flush=True)
        return
    print(f"RESULT forkbomb allowed {count}", flush=True)


def memory():
    hoard = []
    for i in range(1, 1000):
        hoard.append(bytearray(16 * 2**20))
        for j in range(0, len(hoard[-1]), 4096):
            hoard[-1][j] = 1  # touched: resident, not just reserved
        print(f"holding {i * 16} MiB", flush=True)
    print("RESULT memory allowed 16 GiB", flush=True)


def plant():
    """Leave a link or a FIFO where the root worker reads the job's files (TARGET: what, and where it points)."""
    what, to = TARGET["plant"], TARGET.get("to", "")
    places = {"model-link": Path(os.environ["TRAINJOBS_ARTIFACTS_DIR"], "model.pt"),
              "checkpoint-link": Path(os.environ["TRAINJOBS_CHECKPOINT_DIR"], "step_00000001"),
              "metrics-link": Path(os.environ["TRAINJOBS_METRICS_FILE"]),
              "metrics-fifo": Path(os.environ["TRAINJOBS_METRICS_FILE"]),
              "error-link": Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "error.json"))}
    if what == "nothing":
        print("RESULT plant allowed nothing", flush=True)
        return
    place = places[what]
    place.parent.mkdir(parents=True, exist_ok=True)
    place.unlink(missing_ok=True)
    if what == "metrics-fifo":
        os.mkfifo(place)
    else:
        place.symlink_to(to)
    print(f"RESULT plant allowed {what} at {place}", flush=True)
    if what == "error-link":
        sys.exit(3)  # torchrun's error file of a rank that failed: the root worker reads it


PROBES = {"queue": queue, "files": files, "procs": procs, "daemon": daemon, "linger": linger, "forkbomb": forkbomb,
          "memory": memory, "plant": plant}
PROBES[sys.argv[1]]()
