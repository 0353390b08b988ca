"""How a worker reaches the control plane for its own row: the database itself (today's worker), or the API with a
credential of its own (issue 42, docs/architecture.md "The worker protocol"). Registration, heartbeat and leaving
go through here; the rest of the worker still writes the database until the protocol carries it too.

A joined worker keeps its credential in a file (0600, TRAINJOBS_WORKER_CREDENTIAL_FILE), got once for the join
token an admin made; a credential revoked (401) is `Revoked`: the worker hands its jobs back and stops.
"""

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import ValidationError
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from service.auth.tokens import write_secret
from service.db import UNREACHABLE, is_refusal, make_engine, make_sessionmaker
from service.errors import TrainjobsError
from service.runners import protocol
from service.settings import Settings, get_settings
from service.workers import service as workers

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0
CREDENTIAL_FILE_ENV = "TRAINJOBS_WORKER_CREDENTIAL_FILE"
JOIN_WAIT_S = 300.0  # how long a starting worker waits for its API to answer before it gives up
QUICK_S = 15.0  # for this long a starting worker asks its API every 0.25 s (an API started with it), then backs off


class Revoked(Exception):
    """The API refused this machine's credential: an admin revoked it (or it never joined)."""


class Unreachable(Exception):
    """The control plane did not answer (the API or the database away, a timeout, a 5xx): nothing was refused,
    the same call later may work. A call that changed something answers a replay as the first time."""


class Refused(Exception):
    """The control plane answered that it will not take this call (a 4xx, or the database refusing the
    statement): the same again would be refused again. `status` is the HTTP status (0 in-process)."""

    def __init__(self, detail: str, status: int = 0):
        super().__init__(detail)
        self.detail, self.status = detail, status


class Control(Protocol):
    def call(self, name: str, body: dict) -> dict | None: ...
    def register(self, inventory: dict) -> None: ...
    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None,
             images: list[str] | None = None) -> bool: ...
    def remove(self, worker_id: str) -> None: ...


class DatabaseControl:
    """The worker's own row, written in the database (a worker that holds its URL)."""

    def __init__(self, sessions: sessionmaker[Session] | None, settings: Settings | None = None):
        self._sessions, self.settings = sessions, settings or get_settings()
        self.redis: Redis | None = None

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The database's sessions: the caller's, else made on the first call (a supervisor a test drives alone)."""
        if self._sessions is None:
            self._sessions = make_sessionmaker(make_engine(self.settings.resolved_database_url))
        return self._sessions

    def call(self, name: str, body: dict) -> dict | None:
        """The protocol's call `name` run here, as the API would run it (service/runners/protocol.py): the body
        checked by its model, the handler's answer as JSON data."""
        from service.images import calls as image_calls  # noqa: F401 - the calls of a domain above runners
        from service.runners import calls  # noqa: F401 - registers the runners' calls (the API's router does too)

        found = protocol.CALLS[name]
        try:
            parsed = found.body.model_validate(body)
        except ValidationError as exc:  # a bug of this worker's: the API would answer 422
            raise Refused(str(exc), 422) from exc
        try:
            if self.redis is None:
                self.redis = Redis.from_url(self.settings.redis_url)
            with self.sessions() as db:
                ctx = protocol.Context(protocol.TRUSTED, self.settings, self.redis)
                return protocol.answer_json(found, found.handler(db, ctx, parsed))
        except UNREACHABLE as exc:
            if is_refusal(exc):
                raise Refused(str(exc)) from exc
            raise Unreachable(f"the database is out of reach ({type(exc).__name__})") from exc
        except TrainjobsError as exc:
            raise Refused(str(exc), exc.status_code) from exc

    def register(self, inventory: dict) -> None:
        with self.sessions() as db:
            workers.register(db, **inventory)
            db.commit()

    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None,
             images: list[str] | None = None) -> bool:
        with self.sessions() as db:
            found = workers.beat(db, worker_id=worker_id, draining=draining, pressure=pressure, devices=devices,
                                 images=images)
            db.commit()
        return found

    def remove(self, worker_id: str) -> None:
        with self.sessions() as db:
            workers.remove(db, worker_id=worker_id)
            db.commit()


class ApiControl:
    """The worker's own row, through the API's /v1/worker/ routes with this machine's credential."""

    def __init__(self, api: str, credential: str):
        self.client = httpx.Client(base_url=api.rstrip("/"), timeout=TIMEOUT_S,
                                   headers={"Authorization": f"Bearer {credential}"})

    def _post(self, path: str, body: dict) -> httpx.Response:
        response = self.client.post(path, json=body)
        if response.status_code == 401:
            raise Revoked(response.json().get("detail", "unauthorized"))
        response.raise_for_status()
        return response

    def call(self, name: str, body: dict) -> dict | None:
        """POST /v1/worker/<name> with this machine's credential: its answer's JSON (None for a 204)."""
        try:
            response = self.client.post(f"/v1/worker/{name}", json=body)
        except httpx.TransportError as exc:
            raise Unreachable(f"the API is out of reach ({type(exc).__name__}: {exc})") from exc
        if response.status_code == 401:
            raise Revoked(_detail(response))
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise Unreachable(f"the API answered HTTP {response.status_code}: {_detail(response)}")
        if response.status_code >= 400:
            raise Refused(_detail(response), response.status_code)
        return None if response.status_code == 204 else response.json()

    def register(self, inventory: dict) -> None:
        self._post("/v1/worker/register", inventory)

    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None,
             images: list[str] | None = None) -> bool:
        body = {"worker_id": worker_id, "draining": draining, "pressure": pressure, "devices": devices,
                "images": images}
        return self._post("/v1/worker/heartbeat", body).json()["registered"]

    def close(self) -> None:
        self.client.close()

    def remove(self, worker_id: str) -> None:
        response = self.client.delete(f"/v1/worker/workers/{worker_id}")
        if response.status_code == 401:
            raise Revoked(response.json().get("detail", "unauthorized"))
        response.raise_for_status()


def _post_when_up(url: str, *, json: dict, headers: dict, wait_s: float = JOIN_WAIT_S) -> httpx.Response:
    """POST once the API answers: a machine may start before its API (a reboot of both, a compose file's order);
    it waits, as a kubelet does for its API server, and gives up after `wait_s`."""
    started = time.monotonic()
    deadline, delay = started + wait_s, 0.25
    while True:
        try:
            response = httpx.post(url, json=json, headers=headers, timeout=TIMEOUT_S)
            if response.status_code < 500:
                return response
            why = f"HTTP {response.status_code}"
        except httpx.TransportError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() + delay > deadline:
            raise SystemExit(f"trainjobs worker: {url} did not answer for {wait_s:.0f}s ({why})")
        if time.monotonic() - started > QUICK_S:  # an API starting beside it answers within seconds: no backoff yet
            log.warning("the API is not answering yet (%s); trying again in %.1fs", why, delay)
            delay = min(10.0, delay * 2)
        time.sleep(delay)


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text[:500]


def for_worker(settings: Settings, sessions: sessionmaker[Session] | None) -> "Control":
    """How this process reaches the control plane: the API with the machine's saved credential where the worker
    joined one (through its relay, worker/tick.py, where it runs one), else the database."""
    found = saved(settings)
    if found is None:
        return DatabaseControl(sessions, settings)
    from worker.tick import SOCKET_ENV, Relayed  # NOTE: worker/tick.py builds on this module

    relay = os.environ.get(SOCKET_ENV)  # the worker's relay: its processes' ships and leases in one tick
    return Relayed(found, relay) if relay else found


def runner_name() -> str:
    """This machine's name in the pool: TRAINJOBS_WORKER_NAME where set, else its host name. Its worker processes
    are named `<runner>-<pid>` (or the set name), their lanes `<name>.<i>`."""
    return os.environ.get("TRAINJOBS_WORKER_NAME") or socket.gethostname()


def credential_file(settings: Settings, runner: str) -> Path:
    """Where this machine keeps its credential: TRAINJOBS_WORKER_CREDENTIAL_FILE, else one file per runner in the
    secrets dir (several workers of one data dir, named apart, are several runners)."""
    return settings.worker_credential_file or settings.resolved_secrets_dir / f"worker-credential-{runner}.json"


def saved(settings: Settings) -> ApiControl | None:
    """This machine's control through the API, from the credential its worker saved when it joined (a work-horse
    uses it: the worker put the file's path in its environment); None for a worker that writes the database."""
    if settings.worker_api is None:
        return None
    path = os.environ.get(CREDENTIAL_FILE_ENV) or credential_file(settings, runner_name())
    found = json.loads(Path(path).read_text())
    return ApiControl(settings.worker_api, found["credential"])


def joined(settings: Settings, *, runner: str) -> ApiControl:
    """This machine's control through the API: its saved credential, else one got now for the join token.

    Several workers starting at once on one machine (`trainjobs up --workers 4`) join one at a time (a file
    lock): the first exchanges the token, the others read what it saved. Each join revokes the runner's earlier
    credential, so a second join would cut the first worker off.
    """
    assert settings.worker_api is not None
    path = credential_file(settings, runner)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ[CREDENTIAL_FILE_ENV] = str(path)  # for the work-horses this process forks
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            found = json.loads(path.read_text())
            if found.get("api") == settings.worker_api and found.get("runner") == runner:
                return ApiControl(settings.worker_api, found["credential"])
        return _join(settings, runner=runner, path=path)


def _join(settings: Settings, *, runner: str, path: Path) -> ApiControl:
    given = settings.join_token_file
    token = settings.worker_join_token or (given.read_text().strip() if given and given.is_file() else None)
    if not token:
        raise SystemExit(f"trainjobs worker: {path} holds no credential for {settings.worker_api} and no join token "
                         "was given: ask an admin for one (trainjobs worker-token create) and pass --join-token "
                         "(or name its file: TRAINJOBS_JOIN_TOKEN_FILE)")
    response = _post_when_up(f"{settings.worker_api.rstrip('/')}/v1/worker/join", json={"runner": runner},
                             headers={"Authorization": f"Bearer {token}"})
    if response.status_code != 201:
        raise SystemExit(f"trainjobs worker: joining {settings.worker_api} failed: HTTP {response.status_code}: "
                         f"{_detail(response)}")
    answer = response.json()
    write_secret(path, json.dumps({"api": settings.worker_api, "runner": runner, "credential": answer["credential"],
                                   "credential_id": answer["credential_id"]}))
    log.info("joined %s as runner %s (credential %s, kept in %s)", settings.worker_api, runner,
             answer["credential_id"], path)
    return ApiControl(settings.worker_api, answer["credential"])
