"""One request per worker per tick (issue 42, docs/architecture.md "The worker protocol"): the worker's relay
gathers what its processes send the API (the heartbeat, every attempt's lease renewal, every batch it ships) and
sends it as one `tick` call, at most one per tick.

A joined worker's main process serves a Unix socket in a folder of its own (0700, never mounted into a sandbox);
its lanes' work-horses reach it through `Relayed`, the Control they are given (worker/control.py `saved`), which
sends `ship`, `event` and `leases` there and every other call to the API itself. The relay sends what waits at
most once per `window_s` (the supervisors' poll_s), so a worker running 8 jobs sends ~1 request a tick instead of
a heartbeat, 8 renewals and up to 8 ships; each caller blocks until its part of the answer comes, as it would on
its own call. The answer's failures reach each caller as its own call's would (`Unreachable`, `Refused`,
`Revoked`). A tick the API refuses whole (an API without `tick`, a bad part) is sent again call by call, so one bad
batch is refused alone. A relay out of reach (the worker's main process gone) sends the call itself.
"""

import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field

from worker.control import ApiControl, Refused, Revoked, Unreachable

log = logging.getLogger(__name__)
SOCKET_ENV = "TRAINJOBS_WORKER_TICK_SOCKET"
RELAYED = frozenset({"ship", "event", "leases"})
TICK_BYTES_MAX = 2**24  # what one tick carries at most (the API's worker_max_body_bytes is 32 MiB); the rest waits
HEAVY_BYTES = 2**20  # batches past this go in a tick after the renewals' own (a big COPY must not delay a lease)
ANSWER_WAIT_S = 60.0  # a caller's longest wait for its answer: a tick in flight, then its own (each ≤ 10 s)
_HEADER = struct.Struct("!I")
PATH_MAX = 107  # the longest path a Unix socket may have (sun_path)
_PARTS = {"ship": "ships", "event": "events"}


def _send_frame(sock: socket.socket, data: dict) -> None:
    payload = json.dumps(data).encode()
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _read_frame(sock: socket.socket) -> tuple[dict, int] | None:
    """The next frame's data and its size; None once the other end closed."""
    header = _read_exact(sock, _HEADER.size)
    if header is None:
        return None
    payload = _read_exact(sock, _HEADER.unpack(header)[0])
    return None if payload is None else (json.loads(payload), len(payload))


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


@dataclass(eq=False)
class Waiting:
    """One caller's call, waiting for its tick."""

    name: str
    body: dict
    size: int
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None
    error: Exception | None = None

    def settle(self, answer: dict | None = None, error: Exception | None = None) -> None:
        self.answer, self.error = answer, error
        self.done.set()


class Relay:
    """The worker's relay: a socket its processes send their calls to, and a thread sending them as ticks."""

    def __init__(self, control: ApiControl, *, window_s: float):
        self.control, self.window_s = control, window_s
        self.folder = tempfile.mkdtemp(prefix="trainjobs-tick-")  # 0700: the worker's own
        if len(self.folder) > PATH_MAX - 12:  # a socket's path is short (a long TMPDIR): /tmp's then
            os.rmdir(self.folder)
            self.folder = tempfile.mkdtemp(prefix="trainjobs-tick-", dir="/tmp")
        self.path = os.path.join(self.folder, "relay.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        os.chmod(self.path, 0o600)
        self.server.listen(256)
        self.pending: list[Waiting] = []
        self.cond = threading.Condition()
        self.stopped = False
        self.sent = 0  # ticks sent (and what each carried: bench/worker_api.py reads the API's side)
        self._last = 0.0
        self._owner = os.getpid()
        os.register_at_fork(after_in_child=self._forget)  # a lane or work-horse serves nothing

    def _forget(self) -> None:
        if os.getpid() != self._owner:
            self.server.close()

    def start(self) -> "Relay":
        """Serve and send from threads of this process (after the lanes were forked)."""
        for target, name in ((self._accept, "tick-accept"), (self._flush, "tick-send")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.server.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def call(self, name: str, body: dict, *, size: int = 0) -> dict | None:
        """`name` sent in the next tick; its part of the answer, or its call's error."""
        waiting = Waiting(name, body, size or len(json.dumps(body)))
        with self.cond:
            if self.stopped:
                raise Unreachable("the worker's relay stopped")
            self.pending.append(waiting)
            self.cond.notify_all()
        if not waiting.done.wait(ANSWER_WAIT_S):
            raise Unreachable(f"no answer to {name} within {ANSWER_WAIT_S:.0f}s")
        if waiting.error is not None:
            raise waiting.error
        return waiting.answer

    # -- the heartbeat's Control (worker/inventory.py start_heartbeat): the beat rides the tick --------------------

    def register(self, inventory: dict) -> None:
        self.control.register(inventory)

    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None,
             images: list[str] | None = None) -> bool:
        body = {"worker_id": worker_id, "draining": draining, "pressure": pressure, "devices": devices,
                "images": images}
        return self.call("heartbeat", body)["registered"]

    def remove(self, worker_id: str) -> None:
        self.control.remove(worker_id)

    # -- serving the worker's processes --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed: stopping
            threading.Thread(target=self._serve, args=(conn,), name="tick-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    frame = _read_frame(conn)
                except (OSError, ValueError):
                    return
                if frame is None:
                    return
                asked, size = frame
                try:
                    reply = {"answer": self.call(asked["call"], asked["body"], size=size)}
                except Revoked as exc:
                    reply = {"error": "revoked", "detail": str(exc)}
                except Refused as exc:
                    reply = {"error": "refused", "detail": exc.detail, "status": exc.status}
                except Unreachable as exc:
                    reply = {"error": "unreachable", "detail": str(exc)}
                try:
                    _send_frame(conn, reply)
                except OSError:
                    return

    # -- sending ticks -----------------------------------------------------------------------------------------

    def _flush(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    for waiting in self.pending:
                        waiting.settle(error=Unreachable("the worker's relay stopped"))
                    return
                while (left := self._last + self.window_s - time.monotonic()) > 0 and not self.stopped:
                    self.cond.wait(left)  # at most one tick a window: what comes meanwhile joins this one
                taken, size = [], 0
                while self.pending and (not taken or size + self.pending[0].size <= TICK_BYTES_MAX):
                    taken.append(self.pending.pop(0))
                    size += taken[-1].size
            self._last = time.monotonic()
            try:
                light = [w for w in taken if w.name not in _PARTS]
                if len(light) < len(taken) and sum(w.size for w in taken if w.name in _PARTS) > HEAVY_BYTES:
                    self._send(light)  # renewals and the heartbeat never wait behind a heavy tick's writes
                    taken = [w for w in taken if w.name in _PARTS]
                self._send(taken)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave a caller waiting forever
                log.exception("sending a tick failed")
                for waiting in taken:
                    if not waiting.done.is_set():
                        waiting.settle(error=Unreachable(f"the tick failed: {exc}"))

    def _send(self, taken: list[Waiting]) -> None:
        if not taken:
            return
        body: dict = {"heartbeat": None, "leases": [], "ships": [], "events": []}
        beats = [w for w in taken if w.name == "heartbeat"]
        if beats:
            body["heartbeat"] = beats[-1].body
        for waiting in taken:
            if waiting.name == "leases":
                body["leases"].extend(waiting.body["attempts"])
            elif waiting.name in _PARTS:
                body[_PARTS[waiting.name]].append(waiting.body)
        try:
            answer = self.control.call("tick", body)
        except Refused as exc:
            log.warning("the API refused a tick whole (HTTP %s: %s); sending its %d calls one by one", exc.status,
                        exc.detail[:200], len(taken))
            return self._send_each(taken)
        except (Unreachable, Revoked) as exc:
            for waiting in taken:
                waiting.settle(error=exc)
            return
        self.sent += 1
        leases, parts = iter(answer["leases"]), {part: iter(answer[part]) for part in _PARTS.values()}
        for waiting in taken:
            if waiting.name == "heartbeat":
                waiting.settle(answer["heartbeat"])
            elif waiting.name == "leases":
                waiting.settle({"leases": [next(leases) for _ in waiting.body["attempts"]]})
            else:
                acked = next(parts[_PARTS[waiting.name]])
                refused = acked.pop("refused", None)
                if refused:
                    waiting.settle(error=Refused(refused, 422))
                else:
                    waiting.settle(acked)

    def _send_each(self, taken: list[Waiting]) -> None:
        for waiting in taken:
            try:
                if waiting.name == "heartbeat":
                    waiting.settle({"registered": self.control.beat(**waiting.body)})
                else:
                    waiting.settle(self.control.call(waiting.name, waiting.body))
            except (Unreachable, Refused, Revoked) as exc:
                waiting.settle(error=exc)
            except Exception as exc:  # noqa: BLE001 - the heartbeat's own post raises httpx's errors
                waiting.settle(error=Unreachable(f"{type(exc).__name__}: {exc}"))


class Relayed:
    """A work-horse's Control: `ship`, `event` and `leases` through the worker's relay (one tick for all its
    processes), every other call to the API itself; the relay out of reach, those too."""

    def __init__(self, control: ApiControl, path: str):
        self.control, self.path = control, path
        self._local = threading.local()  # one connection per thread (a supervisor's ship loop, its lease thread)

    def call(self, name: str, body: dict) -> dict | None:
        if name not in RELAYED:
            return self.control.call(name, body)
        try:
            reply = self._ask({"call": name, "body": body})
        except OSError as exc:  # the relay is gone (its worker stopping): the call goes itself
            log.debug("the worker's relay is out of reach (%s): calling the API itself", exc)
            self._local.conn = None
            return self.control.call(name, body)
        if "answer" in reply:
            return reply["answer"]
        error, detail = reply["error"], reply.get("detail", "")
        if error == "revoked":
            raise Revoked(detail)
        if error == "refused":
            raise Refused(detail, reply.get("status", 0))
        raise Unreachable(detail)

    def _ask(self, asked: dict) -> dict:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(ANSWER_WAIT_S + 10)
            conn.connect(self.path)
            self._local.conn = conn
        try:
            _send_frame(conn, asked)
            frame = _read_frame(conn)
        except OSError:
            conn.close()
            raise
        if frame is None:
            conn.close()
            raise ConnectionResetError("the relay closed the connection")
        return frame[0]

    def __getattr__(self, name: str):  # register, beat, remove, close: the API's own
        return getattr(self.control, name)
