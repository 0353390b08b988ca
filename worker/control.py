"""How a worker reaches the control plane for its own row: the database itself (today's worker), or the API with a
credential of its own (issue 42, docs/architecture.md "The worker protocol"). Registration, heartbeat and leaving
go through here; the rest of the worker still writes the database until the protocol carries it too.

A joined worker keeps its credential in a file (0600, TRAINJOBS_WORKER_CREDENTIAL_FILE), got once for the join
token an admin made; a credential revoked (401) is `Revoked`: the worker hands its jobs back and stops.
"""

import json
import logging
import os
import socket
from pathlib import Path
from typing import Protocol

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.auth.tokens import write_secret
from service.settings import Settings
from service.workers import service as workers

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0


class Revoked(Exception):
    """The API refused this machine's credential: an admin revoked it (or it never joined)."""


class Control(Protocol):
    def register(self, inventory: dict) -> None: ...
    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None) -> bool: ...
    def remove(self, worker_id: str) -> None: ...


class DatabaseControl:
    """The worker's own row, written in the database (a worker that holds its URL)."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def register(self, inventory: dict) -> None:
        with self.sessions() as db:
            workers.register(db, **inventory)
            db.commit()

    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None) -> bool:
        with self.sessions() as db:
            found = workers.beat(db, worker_id=worker_id, draining=draining, pressure=pressure, devices=devices)
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

    def register(self, inventory: dict) -> None:
        self._post("/v1/worker/register", inventory)

    def beat(self, *, worker_id: str, draining: bool, pressure: str | None, devices: list[dict] | None) -> bool:
        body = {"worker_id": worker_id, "draining": draining, "pressure": pressure, "devices": devices}
        return self._post("/v1/worker/heartbeat", body).json()["registered"]

    def renew(self, *, job_id: str, attempt: int, node_rank: int) -> dict | None:
        """One attempt's lease renewed by the API (the database's clock): what its job asks of it (as
        lifecycle.Held's fields), or None once the attempt lost its job."""
        body = {"attempts": [{"job_id": job_id, "attempt": attempt, "node_rank": node_rank}]}
        [lease] = self._post("/v1/worker/leases", body).json()["leases"]
        return lease["held"]

    def remove(self, worker_id: str) -> None:
        response = self.client.delete(f"/v1/worker/workers/{worker_id}")
        if response.status_code == 401:
            raise Revoked(response.json().get("detail", "unauthorized"))
        response.raise_for_status()


def runner_name() -> str:
    """This machine's name in the pool: TRAINJOBS_WORKER_NAME where set, else its host name. Its worker processes
    are named `<runner>-<pid>` (or the set name), their lanes `<name>.<i>`."""
    return os.environ.get("TRAINJOBS_WORKER_NAME") or socket.gethostname()


def credential_file(settings: Settings) -> Path:
    return settings.worker_credential_file or settings.resolved_secrets_dir / "worker-credential.json"


def saved(settings: Settings) -> ApiControl | None:
    """This machine's control through the API, from the credential its worker saved when it joined (a work-horse
    uses it); None for a worker that writes the database itself."""
    if settings.worker_api is None:
        return None
    found = json.loads(credential_file(settings).read_text())
    return ApiControl(settings.worker_api, found["credential"])


def joined(settings: Settings, *, runner: str) -> ApiControl:
    """This machine's control through the API: its saved credential, else one got now for the join token."""
    assert settings.worker_api is not None
    path = credential_file(settings)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("api") == settings.worker_api and saved.get("runner") == runner:
            return ApiControl(settings.worker_api, saved["credential"])
    if not settings.worker_join_token:
        raise SystemExit(f"trainjobs worker: {path} holds no credential for {settings.worker_api} and no join token "
                         "was given: ask an admin for one (trainjobs worker-token create) and pass --join-token")
    response = httpx.post(f"{settings.worker_api.rstrip('/')}/v1/worker/join", json={"runner": runner},
                          headers={"Authorization": f"Bearer {settings.worker_join_token}"}, timeout=TIMEOUT_S)
    if response.status_code != 201:
        raise SystemExit(f"trainjobs worker: joining {settings.worker_api} failed: HTTP {response.status_code}: "
                         f"{response.json().get('detail', response.text)}")
    answer = response.json()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_secret(path, json.dumps({"api": settings.worker_api, "runner": runner, "credential": answer["credential"],
                                   "credential_id": answer["credential_id"]}))
    log.info("joined %s as runner %s (credential %s, kept in %s)", settings.worker_api, runner,
             answer["credential_id"], path)
    return ApiControl(settings.worker_api, answer["credential"])
