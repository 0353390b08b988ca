"""`trainjobs worker-token create|list|revoke` and `trainjobs runner list|revoke`: the machines that join the pool
through the API with a credential of their own (issue 42). Adding a GPU machine is two commands: an admin's
`trainjobs worker-token create`, then on the machine `trainjobs worker --api URL --join-token T`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole
from service.cli.tokens import parse_duration

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client
    from rich.table import Table

    from trainjobs.client import Client

err = LazyConsole(stderr=True, markup=False, highlight=False)  # plain sentences: no colours on numbers


def cmd_create(args, client: Client) -> int:
    made = client.create_join_token(**{k: v for k, v in (("expires_in_s", args.expires), ("uses", args.uses))
                                       if v is not None})
    return tables.answer(made, args.json, show_secret)


def show_secret(made: dict) -> None:
    print(made["token"])  # alone on stdout: T=$(trainjobs worker-token create --uses 1)
    limits = [f"expires {made['expires_at']}" if made["expires_at"] else "",
              f"{made['uses_left']} use(s)" if made["uses_left"] is not None else ""]
    limits = ", ".join(x for x in limits if x) or "no expiry, any number of machines"
    err.print(f"join token {made['id']} ({limits}). On the new machine: trainjobs worker --api URL "
              "--join-token TOKEN. It is shown only now; the service keeps only its hash.", soft_wrap=True)


def cmd_list(args, client: Client) -> int:
    return tables.answer(client.join_tokens(), args.json, join_tokens_table)


def join_tokens_table(rows: list[dict]) -> Table:
    from rich.table import Table

    table = Table("id", "created by", "created", "expires", "uses left", "revoked")
    for t in rows:
        table.add_row(t["id"], t["created_by"], str(t["created_at"]), str(t["expires_at"] or ""),
                      "any" if t["uses_left"] is None else str(t["uses_left"]), str(t["revoked_at"] or ""))
    return table


def cmd_revoke(args, client: Client) -> int:
    return tables.answer(client.revoke_join_token(args.token_id), args.json,
                         lambda row: f"join token {row['id']} revoked: no machine joins with it now", to=err)


def cmd_runners(args, client: Client) -> int:
    return tables.answer(client.runners(), args.json, runners_table)


def runners_table(rows: list[dict]) -> Table:
    from rich.table import Table

    table = Table("runner", "credential", "joined", "revoked")
    for r in rows:
        table.add_row(r["runner"], r["credential_id"], str(r["created_at"]), str(r["revoked_at"] or ""))
    return table


def cmd_revoke_runner(args, client: Client) -> int:
    return tables.answer(client.revoke_runner(args.runner), args.json,
                         lambda rows: f"runner {args.runner}'s credential revoked: its worker hands its jobs back "
                                      "and stops", to=err)


def register(sub) -> None:
    token = sub.add_parser("worker-token", help="join tokens for new machines (admins): create, list, revoke")
    verbs = token.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="a new join token; prints it alone on stdout")
    create.add_argument("--expires", type=parse_duration, metavar="DURATION", help="e.g. 1h, 7d; default never")
    create.add_argument("--uses", type=int, metavar="N", help="how many machines may join with it; default any")
    create.set_defaults(remote=cmd_create)
    ls = verbs.add_parser("list", help="join tokens; never the secrets")
    ls.set_defaults(remote=cmd_list)
    revoke = verbs.add_parser("revoke", help="revoke a join token by its id (joined machines keep theirs)")
    revoke.add_argument("token_id")
    revoke.set_defaults(remote=cmd_revoke)
    runner = sub.add_parser("runner", help="the machines that joined (admins): list, revoke")
    rverbs = runner.add_subparsers(dest="verb", required=True)
    rls = rverbs.add_parser("list", help="each machine's credentials, live and revoked")
    rls.set_defaults(remote=cmd_runners)
    rrevoke = rverbs.add_parser("revoke", help="revoke a machine's credential: its worker hands its jobs back and "
                                "stops")
    rrevoke.add_argument("runner")
    rrevoke.set_defaults(remote=cmd_revoke_runner)
    for p in (create, ls, revoke, rls, rrevoke):
        p.add_argument("--json", action="store_true", help="machine-readable output")
