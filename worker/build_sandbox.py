"""Where a job's requirements are built: pip in a bubblewrap sandbox of its own, reaching only the package index.

pip runs a package's build backend (setup.py, an in-tree PEP 517 backend): code the job chose, so it runs where the
job's code runs (DESIGN.md rule 6), never as the worker:

- **uid**: a root worker drops the build to the job's uid (sandbox.job_uid, setpriv as for the job), then takes the
  built env back (root's, no write bit for others) before any job uses it; a worker that is not root builds in a
  user namespace as its own uid. Either way a job mounts its env read-only.
- **mounts**: the system and the worker's Python read-only, the env being built read-write, a private /tmp, the
  local indexes, find-links folders and files that pip's configuration names, read-only. Not the data dir (its
  secrets, database, other jobs, other envs), not the worker's home. No pip cache: a cache one tenant's build
  writes and another's reads would let the first poison the second's env.
- **network**: a namespace with loopback alone (--unshare-net). pip's proxy is a relay inside (build_relay.py,
  127.0.0.1) to a Unix socket bound in, where the worker's filtering proxy (Proxy) listens: it opens a tunnel only
  to the hosts of the index URLs and find-links of pip's configuration (pypi.org brings files.pythonhosted.org),
  TRAINJOBS_PIP_INDEX_HOSTS, and, where TRAINJOBS_ALLOW_DIRECT_URLS allows them, the hosts of the build's own
  `name @ https://...` requirements; it resolves the name itself and connects to the address it checked, never to
  loopback, link-local, multicast or reserved ones, and to a private one (10/8, 172.16/12, 192.168/16, 100.64/10,
  fc00::/7) only for a host the operator configured.

Why a proxy rather than a namespace whose only route is the index's address: an index behind a CDN has many
addresses that change, and a route to an address is a route to every name served there; a CONNECT proxy checks the
name pip asked for and the address it resolves to, on every connection, in a page of standard library.
"""

import ast
import collections
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

from service.settings import Settings
from trainjobs.spec import direct_reference
from worker import cgroups, sandbox

log = logging.getLogger(__name__)
RELAY = Path(__file__).with_name("build_relay.py")
IN_BOX = "/run/trainjobs-build"  # the proxy's socket and pip's configuration, inside the sandbox
DEFAULT_INDEX = "https://pypi.org/simple"
FILES_HOSTS = {"pypi.org": "files.pythonhosted.org"}  # where an index's files lie when not on the index's host
# pip's options passed on from the worker's configuration (its files and PIP_* variables) to the sandboxed pip.
PASSED = ("index-url", "extra-index-url", "find-links", "no-index", "trusted-host", "cert", "client-cert",
          "constraint", "timeout", "default-timeout", "retries", "pre", "only-binary", "no-binary")
PRECEDENCE = ("global", "install", ":env:")  # a later section's value wins, as pip reads them
PRIVATE = [ipaddress.ip_network(n) for n in ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12",
                                             "192.168.0.0/16", "198.18.0.0/15", "fc00::/7", "fec0::/10")]
HEADER_MAX = 65536
REFUSALS_KEPT = 50
MAX_CONNECTIONS = 64  # at once, per build: a thread each in the worker, so a build cannot flood it
BUILD_PIDS_MAX = 1024  # pip, a build backend and its compilers' processes and threads


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """The worker's own pip options that say where packages come from (and how): `pip config list`, merged."""
    done = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PIP_CONFIG_FILE" or v})
    found: dict[str, dict[str, str]] = {s: {} for s in PRECEDENCE}
    for line in done.stdout.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if section in found and key in PASSED:
            try:
                found[section][key] = str(ast.literal_eval(value))
            except (ValueError, SyntaxError):
                continue
    return {k: v for s in PRECEDENCE for k, v in found[s].items()}


def index_urls(config: dict[str, str]) -> list[str]:
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        return []
    return [config.get("index-url") or DEFAULT_INDEX, *config.get("extra-index-url", "").split()]


def local_paths(config: dict[str, str]) -> list[str]:
    """What pip reads from the worker's disk: file:// indexes (with the folder above one named simple, where a
    mirror keeps its files), find-links folders, the cert and constraint files. Read-only in the sandbox."""
    paths = []
    for url in index_urls(config):
        if url.startswith("file:"):
            index = Path(unquote(urlsplit(url).path))
            paths.append(index.parent if index.name == "simple" else index)
    for link in config.get("find-links", "").split():
        paths.append(Path(unquote(urlsplit(link).path)) if link.startswith("file:") else Path(link))
    for key in ("cert", "client-cert"):
        if config.get(key):
            paths.append(Path(config[key]))
    paths += [Path(p) for p in config.get("constraint", "").split()]
    return sorted({str(p.resolve()) for p in paths
                   if p.is_absolute() and p.exists() and not p.resolve().is_relative_to("/usr")
                   and not p.resolve().is_relative_to("/etc")})


def allowed_hosts(config: dict[str, str], settings: Settings, requirements: list[str]) -> dict[str, set[int]]:
    """host -> the ports a build may reach it on. Hosts of direct references come in only where allowed."""
    hosts: dict[str, set[int]] = collections.defaultdict(set)

    def add(url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme in ("http", "https") and parts.hostname:
            hosts[parts.hostname.lower()].add(parts.port or (443 if parts.scheme == "https" else 80))

    for url in [*index_urls(config), *config.get("find-links", "").split()]:
        add(url)
    for index, files in FILES_HOSTS.items():
        if index in hosts:
            hosts[files].add(443)
    for item in settings.pip_index_hosts.split(","):
        if item.strip():
            host, _, port = item.strip().rpartition(":") if item.strip()[-1].isdigit() else (item.strip(), "", "")
            hosts[host.strip("[]").lower()].add(int(port) if port else 443)
    configured = set(hosts)
    if settings.allow_direct_urls:
        for line in requirements:
            if (url := direct_reference(line)) and urlsplit(url).hostname not in configured:
                add(url)
    return dict(hosts)


def refused_address(address: str, *, configured: bool) -> str | None:
    """Why the proxy does not connect to `address`, if it does not."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return f"{ip} is a loopback, link-local or reserved address"
    if not configured and any(ip in net for net in PRIVATE):
        return f"{ip} is a private address"
    return None


class Proxy:
    """The filtering forward proxy outside the sandbox: HTTP CONNECT (https) and absolute-URI requests (http),
    on a Unix socket. A thread per connection: a build opens a few at a time."""

    def __init__(self, path: Path, hosts: dict[str, set[int]], *, configured: set[str]):
        self.path, self.hosts, self.configured = path, hosts, configured
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSALS_KEPT)
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def __enter__(self) -> "Proxy":
        self._server.bind(str(self.path))
        os.chmod(self.path, 0o666)  # the build's uid connects; the folder above it keeps the host's users out
        self._server.listen(64)
        threading.Thread(target=self._accept, daemon=True, name="build-proxy").start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        with self._lock:
            for s in list(self._socks):
                _close(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                crowded = len(self._socks) >= 2 * MAX_CONNECTIONS  # a client and its upstream each
            if crowded:
                self._refuse(client, "a connection", f"more than {MAX_CONNECTIONS} at once")
                continue
            self._keep(client)
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.add(s)

    def _handle(self, client: socket.socket) -> None:
        try:
            client.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                if len(head) > HEADER_MAX or not (data := client.recv(8192)):
                    return _close(client)
                head += data
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = (lines[0].split(" ") + ["", ""])[:3]
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                path = ""
            else:
                parts = urlsplit(target)
                if parts.scheme != "http":
                    return self._refuse(client, f"{method} {target[:200]}", "only CONNECT and http:// requests")
                host, port = parts.hostname or "", str(parts.port or 80)
                path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = host.strip("[]").lower().rstrip(".")
            if host not in self.hosts or not port.isdigit() or int(port) not in self.hosts[host]:
                return self._refuse(client, f"{method} {target[:200]}", "not the package index")
            upstream, why = self._connect(host, int(port))
            if upstream is None:
                return self._refuse(client, f"{method} {target[:200]}", why)
            client.settimeout(None)
            if method == "CONNECT":
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                kept = [h for h in lines[1:] if h.split(":", 1)[0].strip().lower() not in
                        ("connection", "keep-alive", "proxy-connection", "proxy-authorization")]
                rest = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""]).encode(
                    "latin-1") + rest
            self._keep(upstream)
            if rest:
                upstream.sendall(rest)
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
            _pipe(client, upstream)
            with self._lock:
                self._socks.discard(upstream)
        except OSError:
            _close(client)
        finally:
            with self._lock:
                self._socks.discard(client)

    def _connect(self, host: str, port: int) -> tuple[socket.socket | None, str]:
        """A connection to `host` at an address it resolves to that may be reached: the name is resolved here,
        and the address checked is the one connected to (no second lookup to rebind)."""
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            return None, f"cannot resolve {host}: {exc}"
        why = f"{host} has no address"
        for family, kind, proto, _, address in found:
            if why_not := refused_address(address[0], configured=host in self.configured):
                why = why_not
                continue
            upstream = socket.socket(family, kind, proto)
            try:
                upstream.settimeout(30)
                upstream.connect(address)
                upstream.settimeout(None)
                return upstream, ""
            except OSError as exc:
                why = f"cannot connect to {host}: {exc}"
                _close(upstream)
        return None, why

    def _refuse(self, client: socket.socket, what: str, why: str) -> None:
        self.refused.append(f"{what}: {why}")
        try:
            client.sendall(f"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                           f"trainjobs build proxy: {why}\n".encode())
        except OSError:
            pass
        _close(client)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class Build:
    """One build in its sandbox: `with Build(...) as b: subprocess.Popen(b.command(argv), env=b.env,
    preexec_fn=b.preexec)`; its proxy and folder live as long as the with block."""

    def __init__(self, support: sandbox.Support, settings: Settings, *, env_dir: Path, uid: int | None,
                 requirements: list[str], name: str):
        self.support, self.settings, self.env_dir, self.uid = support, settings, env_dir, uid
        self.config = pip_config()
        hosts = allowed_hosts(self.config, settings, requirements)
        direct = {urlsplit(u).hostname for line in requirements if (u := direct_reference(line))}
        self._outer = Path(tempfile.mkdtemp(prefix="tj-build-"))  # 0700: the host's users do not reach the socket
        self.box = self._outer / "box"
        self.box.mkdir(mode=0o755)
        self.box.chmod(0o755)
        self.proxy = Proxy(self.box / "proxy.sock", hosts, configured=set(hosts) - direct)
        self.cgroup: cgroups.Attempt | None = None
        if support.cgroup:
            group = cgroups.Attempt(f"b{secrets.token_hex(8)}-{os.getpid()}")  # opaque, as an attempt's
            try:
                group.create(memory_bytes=settings.job_memory_bytes or sandbox.default_memory_bytes(),
                             pids_max=settings.job_pids_max or BUILD_PIDS_MAX)
                self.cgroup = group
            except OSError:
                log.exception("could not make the cgroup of build %s; building without limits", name)
                group.remove()

    def __enter__(self) -> "Build":
        conf = self.box / "pip.conf"
        conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in self.config.items()))
        conf.chmod(0o644)
        self.proxy.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.proxy.__exit__(*exc)
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()
        shutil.rmtree(self._outer, ignore_errors=True)

    @property
    def env(self) -> dict[str, str]:
        """bwrap's, setpriv's and pip's environment: the basics a job gets, and pip's own."""
        return {**sandbox.job_env(self.settings), "HOME": "/tmp", "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1",
                "PIP_NO_INPUT": "1", "PIP_CONFIG_FILE": f"{IN_BOX}/pip.conf", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def command(self, argv: list[str]) -> list[str]:
        env_dir, python = str(self.env_dir), str(self.env_dir / "bin" / "python")
        mounts = sandbox._system_mounts()
        mounts += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        for path in [*sandbox._python_paths(python), *local_paths(self.config)]:
            if path != env_dir:
                mounts += ["--ro-bind", path, path]
        mounts += ["--ro-bind", str(self.box), IN_BOX, "--bind", env_dir, env_dir]
        args = [self.support.bwrap, *sandbox._namespace_args(root=self.support.own_uid, network=False),
                *sandbox.with_parents(mounts), "--chdir", env_dir]
        if self.uid is not None:
            args += ["--", sandbox.SETPRIV, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return [*args, "--", python, "-I", str(RELAY), f"{IN_BOX}/proxy.sock", "--", *argv]

    def preexec(self) -> None:
        if self.cgroup is not None:
            self.cgroup.join()


def hand_to(path: Path, uid: int) -> None:
    """The env's files to the build's uid (a root worker, before the build): it writes only there."""
    _walk(path, lambda p, st: os.lchown(p, uid, uid))


def take_back(path: Path) -> None:
    """The built env back to root, with no write, setuid or setgid bit for others: the job's uid (any job's with
    the same requirements) cannot change it. The build's processes are all gone by now (its PID namespace ended
    with it), so nothing races the walk; links are neither followed nor changed."""
    def seal(p: str, st: os.stat_result) -> None:
        os.lchown(p, 0, 0)
        if not os.path.islink(p):
            os.chmod(p, st.st_mode & 0o755)

    _walk(path, seal)


def _walk(path: Path, do) -> None:
    do(str(path), os.lstat(path))
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in (*dirs, *files):
            p = os.path.join(top, name)
            do(p, os.lstat(p))
