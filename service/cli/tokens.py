"""`trainjobs token create|list|revoke`: tokens through the API (an admin token makes them)."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.table import Table

    from trainjobs.client import Client

err = LazyConsole(stderr=True, markup=False)  # names and users are the user's text, printed as text
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """'30d', '12h', '90m', '3600s' or plain seconds."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhdw]?)\s*", text)
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30d, 12h, 90m or 3600")
    return int(match[1]) * UNITS[match[2] or "s"]


def cmd_create(args, client: Client) -> int:
    fields = {"role": "admin" if args.admin else "user", "user": args.user, "expires_in_s": args.expires,
              "team": args.team}
    if args.entrypoints is not None:
        fields["can_run_entrypoints"] = args.entrypoints
    if args.multinode is not None:
        fields["multinode"] = args.multinode
    made = client.create_token(args.name, **{k: v for k, v in fields.items() if v is not None})
    secret = made.pop("token")
    return tables.answer({**made, "token": secret}, args.json, show_secret)


def show_secret(made: dict) -> None:
    print(made["token"])  # alone on stdout: TOKEN=$(trainjobs token create ci)
    expiry = f", expires {made['expires_at']}" if made["expires_at"] else ""
    err.print(f"token {made['id']} ({made['name']}) for user {made['user']}, role {made['role']}{expiry}. "
              "It is shown only now; the service keeps only its hash.")


def cmd_list(args, client: Client) -> int:
    return tables.answer(client.tokens(), args.json, tokens_table)


def tokens_table(page: dict) -> Table:
    from rich.table import Table

    table = Table("id", "name", "user", "role", "created", "last used", "expires", "revoked")
    for t in page["items"]:
        table.add_row(t["id"], t["name"], t["user"], t["role"], t["created_at"], t["last_used_at"] or "",
                      t["expires_at"] or "", t["revoked_at"] or "")
    return table


def cmd_revoke(args, client: Client) -> int:
    return tables.answer(client.revoke_token(args.token_id), args.json,
                         lambda row: f"token {row['id']} ({row['name']}) revoked at {row['revoked_at']}", to=err)


def register(sub) -> None:
    token = sub.add_parser("token", help="API tokens: create (admins), list, revoke")
    verbs = token.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="a new token; prints it alone on stdout")
    create.add_argument("name")
    create.add_argument("--user", help="whose jobs it makes and sees (default: NAME)")
    create.add_argument("--admin", action="store_true", help="role admin: sees and manages everything")
    create.add_argument("--expires", type=parse_duration, metavar="DURATION", help="e.g. 30d, 12h; default never")
    create.add_argument("--entrypoints", action=argparse.BooleanOptionalAction, default=None,
                        help="grant (or --no-entrypoints withdraw) the user's right to run their own scripts")
    create.add_argument("--team", help="put the user in this team (fair share between teams, then users)")
    create.add_argument("--multinode", action=argparse.BooleanOptionalAction, default=None,
                        help="grant (or --no-multinode withdraw) the user's right to run multi-node gangs")
    create.set_defaults(remote=cmd_create)
    ls = verbs.add_parser("list", help="tokens (admins: all; users: their own); never the secrets")
    ls.set_defaults(remote=cmd_list)
    revoke = verbs.add_parser("revoke", help="revoke a token by its id")
    revoke.add_argument("token_id")
    revoke.set_defaults(remote=cmd_revoke)
    for p in (create, ls, revoke):
        p.add_argument("--json", action="store_true", help="machine-readable output")


