"""`trainjobs login [URL] [--token T]`, `trainjobs logout`, `trainjobs whoami`: the per-user config file that the
CLI and `trainjobs.Client()` both read (see trainjobs.client.connect for the order of everything they read).

    trainjobs login https://trainjobs.example.com --token -   # the token from stdin, out of the shell's history

login checks the URL and the token against the API (GET /v1/me) before it saves anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when a command runs, not for `trainjobs --help`
    from trainjobs.client import Client, Connection

console = LazyConsole(markup=False, highlight=False, soft_wrap=True)
err = LazyConsole(stderr=True, markup=False, highlight=False, soft_wrap=True)


def interactive() -> bool:
    return sys.stdin.isatty()


def ask_url(default: str) -> str:
    if not interactive():
        return default
    answer = input(f"API URL [{default}]: ").strip()
    return answer or default


def ask_token(url: str, found: Connection) -> str:
    """The token typed (not echoed), or Enter for the one the CLI would send to that URL now (`found`)."""
    if interactive():
        import getpass  # here: every command imports this module

        hint = f" [Enter: the one from {found.token_from}]" if found.token else ""
        answer = getpass.getpass(f"token for {url}{hint}: ").strip()
        if answer or found.token:
            return answer or found.token
    elif found.token:
        err.print(f"using the token from {found.token_from}")
        return found.token
    raise ValueError(f"no token for {url}: give --token TOKEN (or --token - to read it from stdin); "
                     "`trainjobs token create NAME` on an admin's machine makes one")


def current_config(path) -> dict[str, str]:
    """The config file's keys; a broken file is replaced by login (said on stderr), not a reason to refuse it."""
    from trainjobs.client import read_config

    try:
        return read_config(path)
    except ValueError as exc:
        err.print(f"note: {exc}; login writes it anew")
        return {}


def found_for(url: str) -> Connection:
    """The token the CLI would send to `url` now (a broken config file left out)."""
    from trainjobs.client import connect

    try:
        return connect(url, url_flag="login", token_flag="--token")
    except ValueError:
        return connect(url, environ={**os.environ, "TRAINJOBS_CONFIG": os.devnull})


def cmd_login(args) -> int:
    from service.cli.main import import_httpx

    httpx = import_httpx()
    import trainjobs.client as sdk

    path = sdk.config_path()
    config = current_config(path)
    url = args.url or args.url_flag or ask_url(config.get("api_url") or sdk.DEFAULT_API_URL)
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an API URL: give one such as http://127.0.0.1:8000")
    if args.token == "-":
        token = sys.stdin.readline().strip()
    elif args.token_file:
        token = args.token_file.read_text().strip()
    else:
        token = args.token or ask_token(url, found_for(url))
    if not token:
        raise ValueError("the token is empty")
    checked = sdk.Connection(api_url=url, token=token, url_from="login", token_from="login", config_path=path,
                             admin_token_file=sdk.admin_token_file())
    try:
        with sdk.Client(connection=checked) as client:
            me = client.me()
    except httpx.TransportError as exc:
        raise RuntimeError(f"cannot reach the API at {url} ({exc}); nothing saved") from None
    except sdk.APIError as exc:
        why = "refused the token" if exc.status in (401, 403) else "answered"
        raise RuntimeError(f"the API at {url} {why} (HTTP {exc.status}: {exc.detail}); nothing saved") from None
    sdk.write_config(path, {**config, "api_url": url, "token": token})
    console.print(f"logged in to {url} as {me['user']} (role {me['role']}); saved to {path} (readable by you only)")
    warn_environment(url)
    return 0


def warn_environment(url: str | None) -> None:
    """The environment wins over the config file: say so when it would override what was just saved."""
    from trainjobs.client import lower_env

    env = lower_env()
    if env.get("trainjobs_api_url") and (url is None or env["trainjobs_api_url"].rstrip("/") != url):
        err.print(f"note: TRAINJOBS_API_URL={env['trainjobs_api_url']} is set in this shell and wins over the config "
                  "file (unset it to use the file)")
    if env.get("trainjobs_token"):
        err.print("note: TRAINJOBS_TOKEN is set in this shell and wins over the config file (unset it to use the "
                  "file)")


def cmd_logout(args) -> int:
    from trainjobs.client import config_path, read_config, write_config

    path = config_path()
    config = read_config(path)
    if "token" not in config:
        console.print(f"no token saved in {path}: nothing to do")
    else:
        del config["token"]
        write_config(path, config)
        console.print(f"removed the token for {config.get('api_url', 'the API')} from {path} (the token itself "
                      "stays valid: `trainjobs token revoke ID` ends it)")
    warn_environment(None)
    return 0


def cmd_whoami(args, client: Client) -> int:
    me = client.me()
    c = client.connection
    return tables.answer({**me, "api_url": c.api_url, "api_url_from": c.url_from, "token_from": c.token_from},
                         args.json, lambda me: f"{me['user']} (role {me['role']}) at {me['api_url']}\n  API URL "
                         f"from {me['api_url_from']}; token from {me['token_from'] or 'nowhere (none sent)'}",
                         to=console)


def register(sub) -> None:
    from pathlib import Path

    login = sub.add_parser("login", help="save the API's URL and your token for the CLI and the SDK",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    login.add_argument("url", nargs="?", help="the API, e.g. http://127.0.0.1:8000 (default: asked, or the one "
                       "the CLI finds now)")
    login.add_argument("--url", dest="url_flag", metavar="URL", help="the same as the URL argument")
    login.add_argument("--token", help="the API token; - reads it from stdin (default: asked, not echoed)")
    login.add_argument("--token-file", type=Path, metavar="FILE",
                       help="read the token from FILE (e.g. trainjobs-data-secrets/admin.token after `up`)")
    login.set_defaults(configure=cmd_login)
    logout = sub.add_parser("logout", help="remove the saved token from the config file")
    logout.set_defaults(configure=cmd_logout)
    whoami = sub.add_parser("whoami", help="who the CLI calls the API as, and where it found the URL and token")
    whoami.add_argument("--json", action="store_true", help="as JSON")
    whoami.set_defaults(remote=cmd_whoami)
