"""`trainjobs registry login|list|logout`: your registry logins (or a team's, for an admin), which the service keeps
sealed and lends to the worker that pulls your jobs' images (issue 44). The password is read from stdin (or asked
for on a terminal), never taken as an argument, where any user of the machine could read it (ps)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING
from urllib.parse import quote

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.table import Table

    from trainjobs.client import Client

out, err = LazyConsole(markup=False), LazyConsole(stderr=True, markup=False)
PATH = "/v1/registry-credentials"


def read_password(args) -> str:
    """From stdin (--password-stdin: its first line, as `docker login` reads it), else asked on a terminal."""
    if args.password_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    if not sys.stdin.isatty():
        raise ValueError("no password: pipe it in with --password-stdin (echo \"$TOKEN\" | trainjobs registry login "
                         "REGISTRY --username U --password-stdin)")
    import getpass

    return getpass.getpass(f"password for {args.username} at {args.registry}: ")


def cmd_login(args, client: Client) -> int:
    body = {"username": args.username, "password": read_password(args), **({"team": args.team} if args.team else {})}
    # NOTE: the SDK's private _call until trainjobs.Client has registry methods of its own (not this module's file).
    made = client._call("PUT", f"{PATH}/{quote(args.registry, safe=':[]')}", json=body).json()
    return tables.answer(made, args.json, lambda m: f"login to {m['registry']} as {m['username']} stored for "
                         f"{m['scope']} {m['owner']}: their jobs' images from it are pulled with it", to=err)


def cmd_list(args, client: Client) -> int:
    return tables.answer(client._call("GET", PATH).json(), args.json, logins_table, to=out)


def logins_table(page: dict) -> Table:
    from rich.table import Column, Table

    table = Table(Column("registry", no_wrap=True), "username", "for", "set by", "updated")
    for login in page["items"]:
        table.add_row(login["registry"], login["username"], f"{login['scope']} {login['owner']}", login["set_by"],
                      login["updated_at"])
    return table


def cmd_logout(args, client: Client) -> int:
    params = {k: v for k, v in (("team", args.team), ("user", args.user)) if v}
    gone = client._call("DELETE", f"{PATH}/{quote(args.registry, safe=':[]')}", params=params).json()
    return tables.answer(gone, args.json, lambda g: f"login to {g['registry']} ({g['username']}) of {g['scope']} "
                         f"{g['owner']} deleted", to=err)


def register(sub) -> None:
    registry = sub.add_parser("registry", help="container registry logins for your jobs' images: login, list, logout")
    verbs = registry.add_subparsers(dest="verb", required=True)
    login = verbs.add_parser("login", help="store your login to a registry (admins: --team's); the password from "
                             "stdin")
    login.add_argument("registry", help="host[:port], as your image references name it (docker.io for Docker Hub)")
    login.add_argument("--username", "-u", required=True)
    login.add_argument("--password-stdin", action="store_true", help="read the password (or token) from stdin")
    login.add_argument("--team", help="admins: the team's login, for its members without one of their own")
    login.set_defaults(remote=cmd_login)
    ls = verbs.add_parser("list", help="your logins and your team's (admins: everyone's); never the passwords")
    ls.set_defaults(remote=cmd_list)
    logout = verbs.add_parser("logout", help="delete your login to a registry (admins: --team's or --user's)")
    logout.add_argument("registry")
    logout.add_argument("--team")
    logout.add_argument("--user")
    logout.set_defaults(remote=cmd_logout)
    for p in (login, ls, logout):
        p.add_argument("--json", action="store_true", help="machine-readable output")
