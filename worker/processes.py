"""Find and stop every process of an attempt, however torchrun arranged them."""

import ctypes
import logging
import signal
import time

import psutil

from trainjobs.runenv import PREEMPT_SIGNAL, RUN_TAG_ENV

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, value, 0, 0, 0)


def become_subreaper() -> None:
    """Orphaned ranks (torchrun gone) are re-parented to us, so we can reap them, not leave zombies."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn: torchrun gets SIGTERM if the supervisor itself dies (and stops its ranks)."""
    _prctl(PR_SET_PDEATHSIG, sig)


def prepare_torchrun() -> None:
    """preexec_fn of torchrun: die with the supervisor, and ignore PREEMPT_SIGNAL until a rank handles it.

    NOTE: an ignored signal stays ignored across exec, so torchrun and every rank it starts inherit it: a
    preemption request that reaches a rank still importing torch is dropped (the supervisor sends it again)
    instead of killing it, SIGUSR1's default action. The runtime installs its handler once it can act on it.
    """
    die_with_parent()
    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)


def signal_ranks(root_pid: int, sig: int) -> int:
    """Send `sig` to torchrun's children (the ranks: not torchrun itself, nor the ranks' own children)."""
    try:
        ranks = psutil.Process(root_pid).children()
    except psutil.NoSuchProcess:
        return 0
    for proc in ranks:
        _signal(proc, sig)
    return len(ranks)


def launcher_pid(root_pid: int) -> int:
    """torchrun's pid under `root_pid` (the sandbox's bwrap and its init stand between them); root_pid itself
    when it is torchrun or none is found yet."""
    try:
        tree = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return root_pid
    for proc in tree:
        if is_torchrun(proc):
            return proc.pid
    return root_pid


def is_torchrun(proc: psutil.Process) -> bool:
    """torchrun itself: `python -m torch.distributed.run ...` (bwrap's own argv names it too, further on)."""
    try:
        return proc.cmdline()[1:3] == ["-m", "torch.distributed.run"]
    except (psutil.Error, IndexError):
        return False


def is_sandbox(proc: psutil.Process) -> bool:
    """bwrap, or its init in the PID namespace (worker/sandbox.py): the sandbox around torchrun, no job code."""
    try:
        return proc.name() == "bwrap"
    except psutil.Error:
        return False


def find_processes(root_pid: int, tag: str) -> list[psutil.Process]:
    """The root, its descendants, and any process whose environment carries the run tag."""
    found: dict[int, psutil.Process] = {}
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    try:
        root = psutil.Process(root_pid)
        # NOTE: once torchrun is reaped its pid may belong to another process (pids wrap at pid_max, 32768 on
        # many machines): its tree counts only while the root still carries our tag.
        if _tagged(root.pid, needle):
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    for proc in psutil.process_iter():
        if proc.pid not in found and _tagged(proc.pid, needle):
            found[proc.pid] = proc
    return [p for p in found.values() if _alive(p)]


def _tagged(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class AttemptProcesses:
    """Every process of one attempt, found in a way its processes cannot escape.

    The supervisor is a child subreaper (become_subreaper): whatever an attempt starts stays its descendant,
    however it detaches (a new session, a double fork, its parent's death): the orphan is re-parented to the
    supervisor, not to init. So the attempt's processes are the supervisor's descendants that did not exist
    before torchrun started (by pid and start time, against pid reuse), plus, belt and braces, torchrun's tree
    and whatever carries the run tag. A helper that cleared its environment is found all the same.
    Make it before starting torchrun; set `root_pid` once it runs.
    """

    def __init__(self, tag: str):
        self.tag, self.root_pid = tag, None
        self._me = psutil.Process()
        self._before = {key for p in self._me.children() if (key := _key(p))}

    def find(self) -> list[psutil.Process]:
        found = {p.pid: p for p in find_processes(self.root_pid, self.tag)} if self.root_pid else {}
        # Our children born since the snapshot (torchrun, and whatever was re-parented to us) with their trees;
        # what was already there and its trees are not this attempt's (a test's in-process supervisor has more).
        try:
            new = [p for p in self._me.children() if (key := _key(p)) and key not in self._before]
        except psutil.Error:
            new = []
        for child in new:
            try:
                tree = [child, *child.children(recursive=True)]
            except psutil.Error:
                tree = [child]
            for proc in tree:
                found.setdefault(proc.pid, proc)
        return [p for p in found.values() if _alive(p)]

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM the attempt's processes (torchrun forwards it to its ranks), wait `grace_s`, SIGKILL whatever
        is left.

        Not the sandbox's bwrap and its init (is_sandbox) during the grace: SIGTERM there ends the PID namespace
        at once, and no rank runs its handler (a save on SIGTERM never happens). They end when torchrun does;
        while the sandbox holds nothing else yet (torchrun not started), there is nothing to wait for.
        Returns the pids that were still alive and got SIGKILL. Ends only when none is alive.
        """
        procs = self.find()
        for proc in [p for p in procs if not is_sandbox(p)] or procs:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.find():
            _reap(procs)
            time.sleep(0.1)
        killed = []
        for _ in range(50):  # re-scan: a process may have been forked during the grace period
            left = self.find()
            if not left:
                break
            for proc in left:
                _signal(proc, signal.SIGKILL)
                killed.append(proc.pid)
            psutil.wait_procs(left, timeout=1)
        _reap(procs)
        self.reap()
        if killed:
            log.warning("SIGKILLed %d process(es) of run %s after %.1fs grace", len(set(killed)), self.tag, grace_s)
        return sorted(set(killed))

    def reap(self) -> None:
        """Collect the exit status of every re-parented process of ours that has ended (no zombies left)."""
        try:
            zombies = [p for p in self._me.children() if p.status() == psutil.STATUS_ZOMBIE and p.pid != self.root_pid]
        except psutil.Error:
            return
        _reap(zombies)


def _key(proc: psutil.Process) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _reap(procs: list[psutil.Process]) -> None:
    """Collect exit statuses of our (re-parented) children so they do not linger as zombies."""
    psutil.wait_procs(procs, timeout=0)
