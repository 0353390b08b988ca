"""A job's own dependencies: one virtualenv per requirements list, layered on the worker's, built once per machine.

<data_dir>/envs/<key>/, where key is the sha256 of the requirement lines (sorted), the worker's Python and its
torch. The env is made --system-site-packages --without-pip, and a .pth file in it adds the worker's own
site-packages after its own (site.addsitedir, so the worker's editable installs count too): a job sees its own
packages first, then the worker's (torch, numpy, trainjobs), then the system's. pip is the worker's, run by the
env's Python so that it installs into the env, with a constraint that pins torch to the worker's version: a
requirement that would replace torch fails instead of downloading another build.

pip runs in a sandbox of its own (worker/build_sandbox.py): as the job's uid, or the worker's in a user namespace,
seeing only the env it builds and reaching only the package index; --prefer-binary, and no direct URL reference
unless TRAINJOBS_ALLOW_DIRECT_URLS. On a worker without a sandbox (TRAINJOBS_SANDBOX=off) it runs as the worker,
as the job's own code then does.

Locks (flock on <key>.lock): a build holds it exclusive; an attempt that runs in the env holds it shared until
it ends, so evicting (exclusive, never waiting) never removes an env in use. An env is complete once <key>.ready
exists (beside it, not in it: the build writes in the env, and could plant a link there); an incomplete one found
under the exclusive lock is a build that died: removed, built again.
"""

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from service.settings import Settings
from trainjobs.spec import direct_reference, requirement_problem
from worker import build_sandbox, sandbox
from worker.packages import evict_lru
from worker.shipping import OutputPump

log = logging.getLogger(__name__)
READY = ".ready"  # <key>.ready beside <key>/
POLL_S = 0.2


class RequirementsFailed(Exception):
    """pip could not install the job's requirements (or they cannot be read): the job fails, not retried."""


class BuildStopped(Exception):
    """The attempt was stopped (cancel, lost lease, shutdown) while it waited for or ran pip."""


def torch_version() -> str | None:
    try:
        return metadata.version("torch")  # without importing it: the worker process never loads torch
    except metadata.PackageNotFoundError:
        return None


def env_key(requirements: list[str]) -> str:
    """Same requirements on the same worker Python and torch: the same env."""
    basis = {"requirements": sorted(r.strip() for r in requirements), "python": sys.version,
             "executable": sys.executable, "platform": platform.platform(), "torch": torch_version()}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()


@dataclass
class Env:
    """A ready environment, held (shared lock) until release()."""

    key: str
    path: Path
    reused: bool
    _lock_fd: int

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1


class EnvCache:
    def __init__(self, root: Path, *, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes

    def acquire(self, requirements: list[str], *, output: Callable[[bytes], object], tick: Callable[[], bool],
                timeout_s: float, base_env: dict[str, str], settings: Settings, job_id: str) -> Env:
        """The env for `requirements`, built if this machine has none (in the sandbox, as job `job_id`'s uid on a
        root worker); held until Env.release().

        `output` receives what to show in the attempt's log (pip's own output among it); `tick` is called at least
        every POLL_S while waiting or building and returns True when the attempt must stop (BuildStopped).
        """
        key = env_key(requirements)
        self.root.mkdir(parents=True, exist_ok=True)
        path, fd = self.root / key, os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = False
            while True:
                if _try_lock(fd, fcntl.LOCK_SH) and self._ready(key):
                    (self.root / f"{key}.used").touch()
                    output(f"[trainjobs] requirements: reusing environment {key[:12]} on this machine "
                           f"({len(requirements)} requirement(s)); nothing to install\n".encode())
                    return Env(key, path, reused=True, _lock_fd=fd)
                if _try_lock(fd, fcntl.LOCK_EX):
                    if self._ready(key):  # built meanwhile by the attempt we waited for
                        continue
                    self._build(key, path, requirements, output=output, tick=tick, timeout_s=timeout_s,
                                base_env=base_env, settings=settings, job_id=job_id)
                    fcntl.flock(fd, fcntl.LOCK_SH)  # EX → SH: others may use it now
                    self.evict(keep=key)
                    return Env(key, path, reused=False, _lock_fd=fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
                if not waited:
                    output(f"[trainjobs] requirements: waiting for another job that is building environment "
                           f"{key[:12]} on this machine\n".encode())
                    waited = True
                if tick():
                    raise BuildStopped("stopped while waiting for the environment")
                time.sleep(POLL_S)
        except BaseException:
            os.close(fd)
            raise

    def _ready(self, key: str) -> bool:
        return (self.root / f"{key}{READY}").is_file()

    def _build(self, key: str, path: Path, requirements: list[str], *, output, tick, timeout_s: float,
               base_env: dict[str, str], settings: Settings, job_id: str) -> None:
        for line in requirements:  # the worker's own check too: a requirements file is read only here
            if problem := requirement_problem(line) or (
                    direct_reference(line) and not settings.allow_direct_urls
                    and "a direct URL reference: this worker installs from its package index only "
                        "(TRAINJOBS_ALLOW_DIRECT_URLS allows them)"):
                raise RequirementsFailed(f"requirement {line!r}: {problem}")
        shutil.rmtree(path, ignore_errors=True)  # an earlier build that died half-way
        (self.root / f"{key}{READY}").unlink(missing_ok=True)
        started = time.monotonic()
        support = sandbox.for_worker(settings)
        uid = sandbox.job_uid(settings, job_id) if support.on and support.own_uid else None
        where = (f"in the sandbox as uid {uid}" if uid is not None else "in the sandbox" if support.on
                 else "unsandboxed (TRAINJOBS_SANDBOX=off)")
        output(f"[trainjobs] requirements: building environment {key[:12]} on this machine {where}: "
               f"{', '.join(requirements)}\n".encode())
        venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(path)
        site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
        ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
        (site_packages / "_trainjobs_worker.pth").write_text(  # after the env's own: the job's versions win
            "".join(f"import site; site.addsitedir({d!r})\n" for d in ours))
        (path / "requirements.txt").write_text("\n".join(requirements) + "\n")
        constraints = path / "constraints.txt"
        constraints.write_text(f"torch=={v}\n" if (v := torch_version()) else "")
        argv = [str(path / "bin" / "python"), "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
                "--progress-bar", "off", "--prefer-binary", "-c", str(constraints), "-r",
                str(path / "requirements.txt")]
        env = {**base_env, "PYTHONUNBUFFERED": "1", "PIP_NO_INPUT": "1"}
        env.pop("PYTHONPATH", None)
        box = None
        try:
            if uid is not None:
                build_sandbox.hand_to(path, uid)
            if support.on:
                box = build_sandbox.Build(support, settings, env_dir=path, uid=uid, requirements=requirements,
                                          name=key[:12])
                argv, env = box.command([*argv, "--no-cache-dir"]), box.env
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        with box or nullcontext():
            code, tail = self._run_pip(argv, env, path, box, output=output, tick=tick, timeout_s=timeout_s,
                                       started=started)
        if uid is not None:
            build_sandbox.take_back(path)  # before any job uses it: root's, read-only to every job
        if code != 0:
            shutil.rmtree(path, ignore_errors=True)
            raise RequirementsFailed(f"pip could not install the requirements (exit {code}): {pip_error(tail)}")
        size = sum(p.lstat().st_size for p in path.rglob("*"))
        (self.root / f"{key}.bytes").write_text(str(size))
        (self.root / f"{key}.used").touch()
        (self.root / f"{key}{READY}").write_text(f"{time.time()}\n")
        output(f"[trainjobs] requirements: environment {key[:12]} ready in {time.monotonic() - started:.1f}s\n"
               .encode())

    @staticmethod
    def _run_pip(argv, env, path: Path, box, *, output, tick, timeout_s: float, started: float) -> tuple[int, bytes]:
        """pip's exit code and the end of its output; its output shipped, and stopped on tick() or the timeout."""
        proc = subprocess.Popen(argv, env=env, cwd=path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=box.preexec if box is not None else None)
        pump, tail = OutputPump(proc.stdout.fileno()), b""

        def ship() -> None:
            nonlocal tail
            data = pump.take()
            if box is not None:  # what the proxy refused, said in the job's log
                while box.proxy.refused:
                    data += f"[trainjobs] requirements: the build's proxy refused {box.proxy.refused.popleft()}\n" \
                        .encode()
            tail = (tail + data)[-8192:]
            output(data)

        try:
            while (code := proc.poll()) is None:
                ship()
                if tick():
                    _stop(proc)
                    raise BuildStopped("stopped while pip installed the requirements")
                if time.monotonic() - started > timeout_s:
                    _stop(proc)
                    raise RequirementsFailed(f"installing the requirements ran past {timeout_s:g}s "
                                             "(TRAINJOBS_PIP_TIMEOUT_S) and was stopped")
                time.sleep(POLL_S)
            pump.wait_closed(5.0, POLL_S, lambda: None)
            ship()
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            proc.stdout.close()
        return code, tail

    def evict(self, keep: str | None = None) -> list[str]:
        """Drop the least recently used envs no attempt holds until the cache fits its limit."""
        gone = evict_lru(self.root, max_bytes=self.max_bytes, keep=keep, remove=self._remove)
        if gone:
            log.info("environment cache over %d bytes: evicted %s", self.max_bytes, gone)
        return gone

    def _remove(self, key: str) -> bool:
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                return False  # a running attempt holds it
            (self.root / f"{key}{READY}").unlink(missing_ok=True)
            shutil.rmtree(self.root / key, ignore_errors=True)
            return True
        finally:
            os.close(fd)


def pip_error(output: bytes) -> str:
    """pip's own words: its ERROR lines, else the end of its output."""
    text = output.decode(errors="replace")
    errors = [line.strip() for line in text.splitlines() if line.startswith("ERROR:")]
    return "\n".join(errors)[-2000:] if errors else text.strip()[-2000:]


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """pip and whatever it started (a build backend): SIGTERM to its session, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
