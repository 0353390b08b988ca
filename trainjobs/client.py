"""The SDK (`trainjobs.Client`), which the CLI uses too: every call talks to the API, never to the database.

    from trainjobs import Client, APIError
    c = Client()                                   # found as the CLI finds it (see connect)
    job = c.submit(spec)                           # the job as the API returns it (a dict)
    job = c.wait(job["id"], timeout=600)           # the finished job
    print(c.logs(job["id"]), c.metrics(job["id"], name="loss"))

Return values are the API's JSON as plain dicts (their fields: the README's API table and /docs); every
error the API answers is an APIError carrying `status` and the API's `detail`.

Where the API is and the token to call it with, in this order (the CLI reads the same): the arguments (the
CLI's --api-url and --token), TRAINJOBS_API_URL and TRAINJOBS_TOKEN, the config file `trainjobs login` writes
(TRAINJOBS_CONFIG, else $XDG_CONFIG_HOME/trainjobs/config.toml, else ~/.config/trainjobs/config.toml), the
admin token file of a local `trainjobs up`, then http://127.0.0.1:8000 with no token.
"""

import json
import logging
import os
import ssl
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainjobs.states import TERMINAL

log = logging.getLogger(__name__)
# The server pings an open stream every 15 s (sse-starlette): a read silent for longer is a dead connection.
STREAM_TIMEOUT = httpx.Timeout(10, read=45)
NODE_LOG_POLL_S = 1.0  # how often `logs --follow --node k` reads another node's log


def retry_reason(exc: Exception) -> str:
    """Why a follower may try again: a transport error (refused, reset, timed out: the API restarting, a
    proxy, ...) or a 5xx. Anything else (404, 401, 422: retrying would not change the answer) is raised."""
    if isinstance(exc, httpx.TransportError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, APIError) and exc.status >= 500:
        return str(exc)
    raise exc


class APIError(Exception):
    """What the API answered with a 4xx or 5xx: `status` and its `detail` (a message, or pydantic's field errors)."""

    def __init__(self, status: int, detail, field: str | None = None):
        at = f"{field}: " if field and isinstance(detail, str) and not detail.startswith(field) else ""
        super().__init__(f"HTTP {status}: {at}{format_detail(detail)}")
        self.status, self.detail, self.field = status, detail, field


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of GET /v1/jobs/{id}/events: its kind, its JSON data and its id (a resume cursor)."""

    kind: str
    data: Any
    id: str | None


def parse_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Events from a stream's lines, by the SSE rules this API needs: `event:`, `data:` (joined by newlines),
    `id:` (kept until the next one, as a browser keeps lastEventId), comments (`: ping`) skipped.

    Hand-written (20 lines): httpx-sse would add a dependency for the same loop.
    """
    kind, data, last_id = "message", [], None
    for line in lines:
        if not line:  # a blank line dispatches the event
            if data:
                yield Event(kind, json.loads("\n".join(data)), last_id)
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)
        elif field == "id" and "\0" not in value:
            last_id = value


def format_detail(detail) -> str:
    if isinstance(detail, list):  # pydantic's errors: name each field at fault
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg')}" for e in detail)
    return str(detail)


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """The response, or an APIError with the API's detail."""
    if response.status_code >= 400:
        response.read()  # a streamed response's body
        try:
            body = response.json()
            detail, field = body.get("detail"), body.get("field")
        except ValueError:
            detail, field = response.text, None
        raise APIError(response.status_code, detail, field if isinstance(field, str) else None)
    return response


CONFIG_ENV = "TRAINJOBS_CONFIG"
DEFAULT_API_URL = "http://127.0.0.1:8000"


def lower_env(environ=None) -> dict[str, str]:
    """The environment with lower-case names: TRAINJOBS_* are read in any case, as the server's Settings reads them."""
    return {name.lower(): value for name, value in (os.environ if environ is None else environ).items()}


def config_path(environ=None) -> Path:
    """The per-user config file: TRAINJOBS_CONFIG, else $XDG_CONFIG_HOME/trainjobs/config.toml, else
    ~/.config/trainjobs/config.toml."""
    env = lower_env(environ)
    if env.get("trainjobs_config"):
        return Path(env["trainjobs_config"]).expanduser()
    base = (environ if environ is not None else os.environ).get("XDG_CONFIG_HOME")
    return (Path(base) if base else Path.home() / ".config") / "trainjobs" / "config.toml"


def read_config(path: Path) -> dict[str, str]:
    """The config file's string keys (api_url, token); {} when there is none. A file that is not TOML is a
    ValueError naming it, the line and the column (tomllib's message carries them)."""
    if not path.exists():
        return {}
    import tomllib  # here: 2 ms of a CLI command's start, spent only where there is a file to read

    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not a valid config file ({exc}); fix it, or run `trainjobs login` again") from None
    return {key: value for key, value in data.items() if isinstance(value, str)}


def write_config(path: Path, values: dict[str, str]) -> None:
    """Write the config file whole, readable by its owner only (0600: it holds a token), in one rename."""
    def toml_string(value: str) -> str:  # a TOML basic string: JSON's escapes are TOML's (\uXXXX for the rest)
        return json.dumps(value)

    import tempfile  # here: only login and logout write

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = "# written by `trainjobs login`; read by the CLI and trainjobs.Client()\n" + "".join(
        f"{key} = {toml_string(value)}\n" for key, value in values.items() if value is not None)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600 from the start
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def admin_token_file(environ=None) -> Path:
    """As the server's Settings.admin_token_file: <TRAINJOBS_SECRETS_DIR>/admin.token, by default in the data
    dir's sibling <TRAINJOBS_DATA_DIR>-secrets (./trainjobs-data-secrets), where `trainjobs up` writes it."""
    env = lower_env(environ)
    if env.get("trainjobs_secrets_dir"):
        return Path(env["trainjobs_secrets_dir"]).resolve() / "admin.token"
    data_dir = Path(env.get("trainjobs_data_dir", "./trainjobs-data")).resolve()
    return data_dir.with_name(f"{data_dir.name}-secrets") / "admin.token"


def same_api(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass(frozen=True)
class Connection:
    """Where the API is, the token to call it with, and where each was found (for an error that says so)."""

    api_url: str
    token: str | None
    url_from: str
    token_from: str | None
    config_path: Path
    admin_token_file: Path

    def unauthorized_hint(self) -> str:
        """What a 401 adds: where the token came from, or everywhere a token was looked for."""
        if self.token:
            return (f"the token from {self.token_from} was refused by {self.api_url}: run `trainjobs login "
                    f"{self.api_url}` with a valid token")
        return (f"no token for {self.api_url}: looked at --token, TRAINJOBS_TOKEN, {self.config_path} and "
                f"{self.admin_token_file}; run `trainjobs login {self.api_url} --token ...` (or set TRAINJOBS_TOKEN)")


def connect(api_url: str | None = None, token: str | None = None, *, environ=None,
            url_flag: str = "the base_url argument", token_flag: str = "the token argument") -> Connection:
    """Find the API and the token: the arguments, then TRAINJOBS_API_URL / TRAINJOBS_TOKEN, then the config
    file, then (the token only) a local admin token file, then the default URL.

    NOTE: the config file's token goes only to the API it was checked against (its api_url): a TRAINJOBS_API_URL
    or --api-url that points elsewhere never receives it.
    """
    env = lower_env(environ)
    path = config_path(environ)
    # Read only when something is still to find: a broken file never stops a caller who gave both.
    needed = not (api_url or env.get("trainjobs_api_url")) or not (token or env.get("trainjobs_token"))
    config = read_config(path) if needed else {}
    if api_url:
        url, url_from = api_url, url_flag
    elif env.get("trainjobs_api_url"):
        url, url_from = env["trainjobs_api_url"], "TRAINJOBS_API_URL"
    elif config.get("api_url"):
        url, url_from = config["api_url"], str(path)
    else:
        url, url_from = DEFAULT_API_URL, "the default"
    admin_file = admin_token_file(environ)
    found, token_from = None, None
    if token:
        found, token_from = token, token_flag
    elif env.get("trainjobs_token"):
        found, token_from = env["trainjobs_token"], "TRAINJOBS_TOKEN"
    elif config.get("token") and same_api(config.get("api_url") or url, url):
        found, token_from = config["token"], str(path)
    elif admin_file.is_file():
        try:
            found, token_from = admin_file.read_text().strip() or None, str(admin_file)
        except OSError:  # another user's stack: not ours to read
            pass
    return Connection(api_url=url, token=found, url_from=url_from, token_from=token_from if found else None,
                      config_path=path, admin_token_file=admin_file)


def find_token(settings) -> str | None:
    """TRAINJOBS_TOKEN, else the admin token the API (or `trainjobs up`) wrote into the secrets directory."""
    if settings.token:
        return settings.token
    path = settings.admin_token_file
    return path.read_text().strip() if path.is_file() else None


WAIT_POLL_S = (0.2, 2.0)  # wait() polls from every 0.2 s up to every 2 s (the API's ETag makes a poll cheap)


def tls_for(api_url: str) -> bool | ssl.SSLContext:
    """httpx's `verify` for an API at `api_url`: True (the CA bundle) for https. A plain-http API needs no TLS, and
    loading the CA bundle was a tenth of a CLI command's start (issue 43): a context that trusts no CA, so that a
    redirect to https fails its check rather than pass unchecked."""
    if api_url.lower().startswith("https:"):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname: and no CA to pass either


class Client:
    """The API, from Python. base_url and token: as the CLI finds them when not given (see `connect`)."""

    def __init__(self, base_url: str | None = None, timeout: float = 30, token: str | None = None, *,
                 connection: Connection | None = None):
        self.connection = connection or connect(base_url, token)
        token = self.connection.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.connection.api_url, timeout=timeout, headers=headers,
                                 verify=tls_for(self.connection.api_url))
        self.last_upload = None  # upload_package: what it sent last (None: the API had it already)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self._checked(self.http.request(method, path, **kwargs))

    def _checked(self, response: httpx.Response) -> httpx.Response:
        """raise_for_status, and a 401 says where the token came from, or where none was found."""
        try:
            return raise_for_status(response)
        except APIError as exc:
            if exc.status == 401:
                raise APIError(401, f"{format_detail(exc.detail)} ({self.connection.unauthorized_hint()})") from None
            raise

    def me(self) -> dict:
        """Who the token is: {"user", "role", "token_id", "can_run_entrypoints"} (GET /v1/me)."""
        return self._call("GET", "/v1/me").json()

    def submit(self, spec: dict, *, workdir: str | os.PathLike | None = None, attempts: int = 3,
               allow_unschedulable: bool = False) -> dict:
        """Submit once, even if the connection drops: every retry carries the same Idempotency-Key.

        With `workdir`, the folder is packed and uploaded first (only if the API does not hold it yet) and the
        spec's entrypoint runs in it: `entrypoint.script` is relative to it. A job no live worker could run is
        refused (422 or 403, naming what none has) unless `allow_unschedulable`: then it waits for such a worker.
        """
        if workdir is not None:
            if not isinstance(spec.get("entrypoint"), dict):
                raise ValueError("submit(workdir=...) ships code for an entrypoint: the spec needs 'entrypoint'")
            self.validate(spec, allow_unschedulable=allow_unschedulable)  # a spec refused costs no upload
            spec = {**spec, "entrypoint": {**spec["entrypoint"], "package": self.upload_package(workdir)}}
        headers = {"Idempotency-Key": f"cli-{uuid.uuid4()}"}
        for attempt in range(1, attempts + 1):
            try:
                params = {"allow_unschedulable": "true"} if allow_unschedulable else None
                return self._call("POST", "/v1/jobs", json=spec, headers=headers, params=params).json()
            except httpx.ConnectError:  # nothing sent: no API there (1.5 s of retries only delayed saying so)
                raise
            except httpx.TransportError:
                if attempt == attempts:
                    raise
                time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")

    def validate(self, spec: dict, *, allow_unschedulable: bool = False) -> dict:
        """A dry submit (POST /v1/jobs:validate): the spec as a job would run it, or the APIError a submission
        would get; no job is made and the package (entrypoint.package) is not looked for."""
        params = {"allow_unschedulable": "true"} if allow_unschedulable else {}
        return self._call("POST", "/v1/jobs:validate", json=spec, params=params).json()

    def plan(self, spec: dict) -> dict:
        return self._call("POST", "/v1/plan", json=spec).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def list(self, status: str | None = None, limit: int = 20, *, name: str | None = None,
             tag: str | None = None, sweep: str | None = None, owner: str | None = None,
             cursor: str | None = None) -> dict:
        """A page of jobs, newest first; `name` matches a prefix, `tag` one of spec.tags, `sweep` a sweep's trials,
        `owner` a user's (admins; a user sees only their own); `cursor` (the last page's next_cursor) the page
        after: older jobs (ids below it)."""
        params = {"limit": limit, "status": status, "name": name, "tag": tag, "sweep": sweep, "owner": owner,
                  "cursor": cursor}
        return self._call("GET", "/v1/jobs", params={k: v for k, v in params.items() if v is not None}).json()

    def iter_jobs(self, status: str | None = None, *, name: str | None = None, tag: str | None = None,
                  sweep: str | None = None, owner: str | None = None, page_size: int = 200) -> Iterator[dict]:
        """Every job that matches, newest first, page after page (as they are read: stop when you have enough)."""
        cursor = None
        while True:
            page = self.list(status, page_size, name=name, tag=tag, sweep=sweep, owner=owner, cursor=cursor)
            yield from page["items"]
            if not (cursor := page["next_cursor"]):
                return

    def clone(self, job_id: str, overrides: dict | None = None) -> dict:
        """A new job: this one's spec with `overrides` ({"optimizer.lr": 3e-4}) applied; it names its source."""
        headers = {"Idempotency-Key": f"cli-{uuid.uuid4()}"}
        return self._call("POST", f"/v1/jobs/{job_id}/clone", json={"set": overrides or {}}, headers=headers).json()

    def submit_sweep(self, sweep: dict) -> dict:
        """A sweep (POST /v1/sweeps: name, spec, parameters, method, max_trials, parallel, metric,
        early_stopping, seed); its first trials are made at once, the rest as trials end."""
        return self._call("POST", "/v1/sweeps", json=sweep).json()

    def sweep(self, sweep_id: str) -> dict:
        """The sweep: its status, trial counts and best trial so far."""
        return self._call("GET", f"/v1/sweeps/{sweep_id}").json()

    def sweeps(self, status: str | None = None, limit: int = 20, *, cursor: str | None = None) -> dict:
        """A page of sweeps, newest first; `cursor`: the last page's next_cursor (the sweeps with smaller ids)."""
        params = {"limit": limit} | ({"status": status} if status else {}) | ({"cursor": cursor} if cursor else {})
        return self._call("GET", "/v1/sweeps", params=params).json()

    def trials(self, sweep_id: str) -> "list[dict]":
        """The sweep's trials in order: parameters, status and reason, steps, the metric's last and best value."""
        return self._call("GET", f"/v1/sweeps/{sweep_id}/trials").json()["items"]

    def cancel_sweep(self, sweep_id: str) -> dict:
        return self._call("POST", f"/v1/sweeps/{sweep_id}/cancel").json()

    def wait_sweep(self, sweep_id: str, timeout: float | None = None, poll_s: float = 2.0) -> dict:
        """The sweep once it has ended; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (sweep := self.sweep(sweep_id))["status"] == "running":
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sweep {sweep_id} still running after {timeout}s")
            time.sleep(poll_s)
        return sweep

    def workers(self, state: "str | list[str] | None" = None, *, labels: dict[str, str] | None = None,
                min_free_devices: int | None = None, limit: int | None = None, cursor: str | None = None) -> dict:
        """The workers (by id) in `state` (idle, busy, draining, lost; or a list of them) that carry every label
        and have at least `min_free_devices` devices free: all of them, every page followed, as {items,
        next_cursor: None}; with `limit` or `cursor` (the last page's next_cursor) one page, as the API answers."""
        if limit is None and cursor is None:
            return {"items": list(self.iter_workers(state, labels=labels, min_free_devices=min_free_devices)),
                    "next_cursor": None}
        params = {"state": state, "label": [f"{k}={v}" for k, v in (labels or {}).items()] or None,
                  "min_free_devices": min_free_devices, "limit": limit, "cursor": cursor}
        return self._call("GET", "/v1/workers", params={k: v for k, v in params.items() if v is not None}).json()

    def iter_workers(self, state: "str | list[str] | None" = None, *, labels: dict[str, str] | None = None,
                     min_free_devices: int | None = None, page_size: int = 500) -> Iterator[dict]:
        """Every worker that matches (see `workers`), by id, page after page."""
        cursor = None
        while True:
            page = self.workers(state, labels=labels, min_free_devices=min_free_devices, limit=page_size,
                                cursor=cursor)
            yield from page["items"]
            if not (cursor := page.get("next_cursor")):  # (an API before issue 42 answers all, no next_cursor)
                return

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def attempts(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}/attempts").json()

    def stacks(self, job_id: str) -> dict:
        """Every rank's stack of a running job, without stopping it: {"data": [attempt nodes with "stacks"]}."""
        return self._call("POST", f"/v1/jobs/{job_id}/stacks", timeout=max(self.http.timeout.read or 0, 30)).json()

    def metrics(self, job_id: str, name: str | None = None, node_rank: int = 0, *,
                max_points: int | None = None) -> dict:
        """The job's series ({"series": [{"name", "steps", "values"}]}), or the one named; `max_points` thins each
        to about that many points (min and max per bucket)."""
        params = {"node_rank": node_rank} | ({"name": name} if name else {}) | (
            {"max_points": max_points} if max_points else {})
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params=params).json()

    def metrics_csv(self, job_id: str, name: str | None = None) -> Iterator[str]:
        """Every stored point as CSV lines (step,name,value,node_rank,attempt,time), streamed."""
        params = {"format": "csv"} | ({"name": name} if name else {})
        with self.http.stream("GET", f"/v1/jobs/{job_id}/metrics", params=params) as response:
            self._checked(response)
            yield from response.iter_lines()

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        """The job once it has ended (succeeded, failed or cancelled); TimeoutError after `timeout` seconds.

        Rides out a restarting API or a dropped connection (a 5xx or a transport error is tried again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = WAIT_POLL_S[0]
        while True:
            try:
                job = self.get(job_id)
                if job["status"] in TERMINAL:
                    return job
            except (httpx.TransportError, APIError) as exc:
                log.info("waiting for job %s: %s; trying again", job_id, retry_reason(exc))
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(f"job {job_id} has not ended after {timeout:g} s")
            time.sleep(delay)
            delay = min(delay * 1.5, WAIT_POLL_S[1])

    def logs(self, job_id: str, *, node_rank: int = 0, rank: int | None = None, follow: bool = False
             ) -> str | Iterator[str]:
        """The job's combined output so far (every rank's line marked `[rank<R>]: `; with `rank`, that rank's
        lines unmarked and the lines no rank marked); with follow=True an iterator over it as it grows, until the
        job ends (pushed by the event stream, across dropped connections)."""
        if follow:
            return self.follow_logs(job_id, node_rank=node_rank, rank=rank)
        return self.log_page(job_id, node_rank=node_rank, rank=rank)[0]

    def log_page(self, job_id: str, offset: int = 0, node_rank: int = 0, rank: int | None = None
                 ) -> tuple[str, int, str]:
        """The output from byte `offset` (with `rank`, that rank's lines): its text, the offset to read from next,
        and the job's status."""
        params = {"offset": offset, "node_rank": node_rank} | ({"rank": rank} if rank is not None else {})
        r = self._call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        return r.text, int(r.headers["X-Next-Offset"]), r.headers["X-Job-Status"]

    def artifacts(self, job_id: str) -> "list[dict]":  # a string: `list` is a method here
        """The job's output files: [{"name", "size", "modified"}]."""
        return self._call("GET", f"/v1/jobs/{job_id}/artifacts").json()["items"]

    def download(self, job_id: str, name: str, dest: str | os.PathLike | None = None) -> Path:
        """Save the artifact `name` to `dest`, streamed; returns the file's path. A partial download never stands
        in for the file.

        `dest`: a folder to put it in (one that exists, or a path that ends with "/": made if missing), or else
        the file to write (its folder made if missing); default: the current folder."""
        folder = dest is None or str(dest).endswith(("/", os.sep)) or Path(dest).is_dir()
        dest = Path(dest) if dest is not None else Path.cwd()
        target = dest / Path(name).name if folder else dest
        partial = target.with_name(f".{target.name}.part")
        with self.http.stream("GET", f"/v1/jobs/{job_id}/artifacts/{name}") as r:
            self._checked(r)
            target.parent.mkdir(parents=True, exist_ok=True)  # once the API has the file: no folder for a 404
            try:
                with open(partial, "wb") as out:
                    for chunk in r.iter_bytes(1 << 20):
                        out.write(chunk)
                partial.replace(target)
            finally:
                partial.unlink(missing_ok=True)
        return target

    def events(self, job_id: str, last_event_id: str | None = None, metrics: str = "all") -> Iterator[Event]:
        """One connection to the job's event stream, until the server ends it or the connection drops.
        `metrics`: "all" the points (from the start or last_event_id), "new" those after the series' present
        end, "none" no `metrics` events."""
        headers = {"Accept": "text/event-stream"} | ({"Last-Event-ID": last_event_id} if last_event_id else {})
        params = {"metrics": metrics} if metrics != "all" else {}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, params=params,
                              timeout=STREAM_TIMEOUT) as r:
            yield from parse_sse(self._checked(r).iter_lines())

    def follow_events(self, job_id: str, *, metrics: str = "all", give_up_s: float = 60) -> Iterator[Event]:
        """The job's events up to its terminal status, across dropped connections and API restarts.

        Each reconnect sends the last event id seen, so the API resends status and progress and only the metric
        points not yet seen. Gives up (raises) after give_up_s without a single event.
        """
        last_id, delay, failing_since = None, 0.2, None
        while True:
            try:
                for event in self.events(job_id, last_event_id=last_id, metrics=metrics):
                    last_id, delay, failing_since = event.id or last_id, 0.2, None
                    yield event
                    if event.kind == "status" and event.data.get("status") in TERMINAL:
                        return
                reason = "the stream ended before the job did"
            except (httpx.TransportError, APIError) as exc:
                reason = retry_reason(exc)
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > give_up_s:
                raise RuntimeError(f"lost the event stream of job {job_id} for {give_up_s:.0f} s ({reason})")
            log.info("event stream of job %s dropped (%s); reconnecting from event %s", job_id, reason, last_id)
            time.sleep(delay)  # a backoff between reconnects, not a poll: a live stream pushes every change
            delay = min(delay * 2, 5.0)

    def follow_logs(self, job_id: str, offset: int = 0, node_rank: int = 0, *, rank: int | None = None,
                    give_up_s: float = 60) -> Iterator[str]:
        """The job's output as it grows, until the job ends: the event stream says when the log has grown (a
        `logs` event) or the job has ended, and only then is GET .../logs read from where the last read ended.

        Another node's log (node_rank > 0) is not in the stream's `logs` events: it is read every
        NODE_LOG_POLL_S until a read says the job has ended (that read holds the whole log).
        """
        text, offset, status = self.log_page(job_id, offset, node_rank, rank)
        if text:
            yield text
        if node_rank:
            failing_since = None  # a dropped connection or a restarting API is retried, as the stream is
            while status not in TERMINAL:
                time.sleep(NODE_LOG_POLL_S)
                try:
                    text, offset, status = self.log_page(job_id, offset, node_rank, rank)
                except (httpx.TransportError, APIError) as exc:
                    reason = retry_reason(exc)
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > give_up_s:
                        raise RuntimeError(f"lost node {node_rank}'s log of job {job_id} for {give_up_s:.0f} s "
                                           f"({reason})") from exc
                    continue
                failing_since = None
                if text:
                    yield text
            return
        for event in self.follow_events(job_id, metrics="none"):  # the log and the status only
            grown = event.kind == "logs" and event.data["next_offset"] > offset
            if grown or (event.kind == "status" and event.data["status"] in TERMINAL):
                text, offset, _status = self.log_page(job_id, offset, rank=rank)
                if text:
                    yield text

    def upload_package(self, folder: str | os.PathLike) -> str:
        """Pack `folder` (trainjobs/packing.py) and upload it unless the API holds it for us already; returns its
        digest ("sha256:<hex>") for a spec's entrypoint.package. The file is streamed, never read whole."""
        from trainjobs import packing

        self.last_upload = None
        # An unchanged folder (names, sizes, modification times) that this machine packed before is not packed
        # again to learn its digest: if the API has that package, nothing is read or sent.
        key = packing.fingerprint(folder)
        known = packing.known_digest(key)
        if known is not None and self.http.head(f"/v1/packages/{known}").status_code == 200:
            return known
        with packing.pack(folder) as packed:
            packing.remember_digest(key, packed.digest)
            if self.http.head(f"/v1/packages/{packed.digest}").status_code == 200:
                return packed.digest
            with open(packed.path, "rb") as body:
                self._call("PUT", f"/v1/packages/{packed.digest}", content=body,
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(packed.size)},
                           timeout=httpx.Timeout(30, write=600))
            self.last_upload = packed
            return packed.digest

    def packages(self) -> dict:
        """The caller's packages: {"data": [{"digest", "size", "files", ...}], "count", "bytes"}."""
        return self._call("GET", "/v1/packages").json()

    def delete_package(self, digest: str) -> None:
        self._call("DELETE", f"/v1/packages/{digest}")

    def queue(self) -> dict:
        """The waiting jobs in the order they would start, why each waits, and your standing (GET /v1/queue)."""
        return self._call("GET", "/v1/queue").json()

    def teams(self) -> dict:
        return self._call("GET", "/v1/teams").json()

    def put_team(self, name: str, *, weight: float = 1.0, max_slots: int | None = None) -> dict:
        """Create or change a team (admins)."""
        return self._call("PUT", f"/v1/teams/{name}", json={"weight": weight, "max_slots": max_slots}).json()

    def update_user(self, name: str, **fields) -> dict:
        """Change a user's team, weight, max_slots or multinode right (admins): PATCH /v1/users/{name}."""
        return self._call("PATCH", f"/v1/users/{name}", json=fields).json()

    def create_token(self, name: str, **fields) -> dict:
        return self._call("POST", "/v1/tokens", json={"name": name, **fields}).json()

    def tokens(self) -> dict:
        return self._call("GET", "/v1/tokens").json()

    def revoke_token(self, token_id: str) -> dict:
        return self._call("DELETE", f"/v1/tokens/{token_id}").json()

    def create_join_token(self, **fields) -> dict:
        """A join token for new machines (admins; fields: expires_in_s, uses): its `token` shown once."""
        return self._call("POST", "/v1/worker-tokens", json=fields).json()

    def join_tokens(self) -> "list[dict]":
        return self._call("GET", "/v1/worker-tokens").json()

    def revoke_join_token(self, token_id: str) -> dict:
        return self._call("DELETE", f"/v1/worker-tokens/{token_id}").json()

    def runners(self) -> "list[dict]":
        """The machines that joined the pool, by their credentials (admins)."""
        return self._call("GET", "/v1/runners").json()

    def revoke_runner(self, runner: str) -> "list[dict]":
        """The machine's credential revoked: its worker hands its jobs back and stops (admins)."""
        return self._call("POST", f"/v1/runners/{runner}/revoke").json()

    def create_webhook(self, url: str, **fields) -> dict:
        """A webhook for your jobs' events (fields: events, secret, format, all_users); its `secret` shown once."""
        return self._call("POST", "/v1/webhooks", json={"url": url, **fields}).json()

    def webhooks(self, owner: str | None = None) -> dict:
        return self._call("GET", "/v1/webhooks", params={"owner": owner} if owner else {}).json()

    def webhook(self, webhook_id: str) -> dict:
        return self._call("GET", f"/v1/webhooks/{webhook_id}").json()

    def delete_webhook(self, webhook_id: str) -> dict:
        return self._call("DELETE", f"/v1/webhooks/{webhook_id}").json()

    def webhook_deliveries(self, webhook_id: str, *, status: str | None = None, limit: int = 50) -> dict:
        """The webhook's deliveries, newest first: tries, status codes, answers, the next try."""
        params = {"limit": limit} | ({"status": status} if status else {})
        return self._call("GET", f"/v1/webhooks/{webhook_id}/deliveries", params=params).json()

    def test_webhook(self, webhook_id: str) -> dict:
        """Send a webhook.test event now (once); its delivery: delivered, or given_up with the status or error."""
        return self._call("POST", f"/v1/webhooks/{webhook_id}/test").json()
