"""The CLI's client commands start fast: `trainjobs status ID`, `list`, `--help` only talk HTTP (trainjobs.client),
so they load neither SQLAlchemy nor the server, Redis, rq or torch (each costs a client command a share of the
second it took to start). Server-side commands (up, api, worker, demo, db, gc) import those inside the function
that runs them. No database, Redis or API is needed here: a client command is pointed at a closed port.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main as cli
from service.cli import webhooks as webhooks_cli
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
# The server and its dependencies: a module named so, or any of its submodules, is an offence.
SERVER_SIDE = ("sqlalchemy", "service.db", "service.jobs", "service.api", "service.settings", "fastapi", "starlette",
               "uvicorn", "alembic", "rq", "redis", "torch", "psycopg", "psycopg2")
DEAD_API = "http://127.0.0.1:9"  # nothing listens: a client command fails at once, after its imports


def import_chains(stderr: str) -> dict[str, list[str]]:
    """Each module `-X importtime` reports, with the chain of imports that first loaded it (outermost first).

    Lines are `import time: self | cumulative | <2 spaces per level>name`, a module after the modules it
    imported: a module's importer is the next line one level up."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.rstrip().endswith("imported package"):
            continue
        field = line.split("|", 2)[2]
        name = field.strip()
        rows.append(((len(field) - len(field.lstrip(" ")) - 1) // 2, name))
    chains = {}
    for i, (depth, name) in enumerate(rows):
        chain, level = [name], depth
        for above_depth, above in rows[i + 1:]:
            if above_depth < level:
                chain.insert(0, above)
                level = above_depth
        chains.setdefault(name, chain)
    return chains


def loaded(*args: str) -> dict[str, list[str]]:
    env = {**os.environ, "TRAINJOBS_API_URL": DEAD_API}
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=60)
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    return import_chains(run.stderr)


def offences(chains: dict[str, list[str]], banned: tuple[str, ...]) -> list[str]:
    """How each banned package was first reached (`a -> b -> sqlalchemy`), one chain per package, none for a
    package that only a banned one imported (the chain to that one names the culprit)."""
    def match(name: str) -> str | None:
        return next((b for b in banned if name == b or name.startswith(b + ".")), None)

    first = {}
    for name, chain in chains.items():
        if (package := match(name)) and not any(match(above) for above in chain[:-1]):
            first.setdefault(package, " -> ".join(chain))
    return list(first.values())


@pytest.mark.parametrize("args", [["-m", "service.cli", "--help"], ["-c", "import service.cli.main"],
                                  ["-m", "service.cli", "list"], ["-m", "service.cli", "status", "0" * 20]],
                         ids=["--help", "import", "list", "status"])
def test_client_commands_import_nothing_of_the_server(args):
    chains = loaded(*args)
    assert "service.cli.main" in chains  # the parse worked: the CLI was imported
    bad = offences(chains, SERVER_SIDE)
    assert not bad, "a client command imported server-side modules (import them inside the command that " \
                    "needs them):\n" + "\n".join(bad)


def test_help_parses_arguments_only():
    """`trainjobs --help` loads not even the HTTP client: httpx (and, through it, click and pygments) alone
    takes about as long as the rest of the start."""
    bad = offences(loaded("-m", "service.cli", "--help"), ("httpx", "httpcore", "pydantic", "yaml", "rich"))
    assert not bad, "`trainjobs --help` imported more than it prints:\n" + "\n".join(bad)


@pytest.mark.parametrize("args, banned", [
    (["logs", "0" * 20], ("rich.table", "rich.progress", "rich.live", "yaml", "pydantic")),  # the output as it is
    (["status", "0" * 20], ("rich.progress", "rich.live", "yaml", "pydantic")),  # a table, not a live bar
    (["list"], ("rich.progress", "rich.live", "yaml", "pydantic")),
], ids=["logs", "status", "list"])
def test_a_client_command_imports_only_what_it_prints_with(args, banned):
    """rich is a fifth of a command's start (issue 43): `logs` prints the output as it came, `status` and `list`
    a table (rich.console, rich.table), never the live progress bar of --follow. The API here is a closed port,
    so each prints its `error:` line (rich.console and rich.text), and that without the bar."""
    bad = offences(loaded("-m", "service.cli", *args), banned)
    assert not bad, f"`trainjobs {' '.join(args)}` imported more than it prints with:\n" + "\n".join(bad)


def test_trainjobs_alone_prints_the_help_and_exits_0():
    run = subprocess.run([sys.executable, "-m", "service.cli"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "TRAINJOBS_API_URL": DEAD_API}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: trainjobs") and "submit" in run.stdout and "status" in run.stdout
    assert run.stderr == ""


def test_main_without_arguments_prints_the_help(capsys):
    assert cli.main([]) == 0
    assert capsys.readouterr().out.startswith("usage: trainjobs")


@pytest.mark.parametrize("env", [
    {},
    {"TRAINJOBS_API_URL": "http://api:8000", "TRAINJOBS_TOKEN": "secret", "TRAINJOBS_DATA_DIR": "/srv/tj/data"},
    {"trainjobs_api_url": "http://lower:1", "Trainjobs_Token": "", "TRAINJOBS_DATA_DIR": "rel/data"},
    {"TRAINJOBS_SECRETS_DIR": "/run/tj-secrets", "TRAINJOBS_DATA_DIR": "/srv/tj"},
], ids=["defaults", "set", "any-case", "secrets-dir"])
def test_the_client_settings_are_those_the_server_settings_read(env, monkeypatch, tmp_path):
    """The CLI reads the API's URL and its token without pydantic-settings (see ClientSettings): as Settings would."""
    for name in list(os.environ):
        if name.upper().startswith("TRAINJOBS_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINJOBS_CONFIG", str(tmp_path / "no-config.toml"))  # no `trainjobs login` here
    monkeypatch.chdir(tmp_path)
    light, full = cli.ClientSettings.from_env(), Settings()
    # An empty token is none: neither sends one.
    assert (light.api_url, light.token or None, light.admin_token_file) == (full.api_url, full.token or None,
                                                                            full.admin_token_file)


def test_the_cli_knows_every_webhook_event():
    """The CLI's copy of the event names (the outbox's module loads SQLAlchemy) is the outbox's list."""
    from service.webhooks.outbox import EVENTS

    assert webhooks_cli.EVENTS == EVENTS


def test_a_plain_http_api_loads_no_ca_bundle_and_an_https_one_verifies_as_ever():
    """Loading the CA bundle was ~20 ms of every client command; an http API needs none. Its context trusts no
    CA, so a redirect to https fails its certificate check instead of passing unchecked."""
    import ssl

    from trainjobs.client import tls_for

    assert tls_for("https://trainjobs.example.com") is True and tls_for("HTTPS://x") is True
    plain = tls_for("http://127.0.0.1:8000")
    assert isinstance(plain, ssl.SSLContext) and plain.verify_mode == ssl.CERT_REQUIRED and plain.check_hostname
    assert plain.cert_store_stats()["x509_ca"] == 0


def test_submit_to_an_api_that_is_not_there_fails_at_once(monkeypatch):
    """A refused connection sent nothing: no retry (they took 1.5 s to say the same), unlike a connection dropped
    after the POST went out, which is retried with its Idempotency-Key."""
    import httpx

    from trainjobs import client as sdk

    slept = []
    monkeypatch.setattr(sdk.time, "sleep", slept.append)
    with sdk.Client(DEAD_API, token="tj_x") as api, pytest.raises(httpx.ConnectError):
        api.submit({"name": "x"})
    assert slept == []
