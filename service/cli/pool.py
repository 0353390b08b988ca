"""The fair pool from a terminal: `trainjobs queue`, `trainjobs team set|list`, `trainjobs user set` (admins)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.table import Table

    from trainjobs.client import Client

console = LazyConsole(markup=False)


def cmd_queue(args, client: Client) -> int:
    return tables.answer(client.queue(), args.json, show_queue, to=console)


def show_queue(q: dict) -> Table:
    """Prints the caller's standing and the reservations; returns the waiting jobs in start order, as a table."""
    from rich.table import Table

    you = q["you"]
    team = f", team {you['team']}" if you["team"] else ""
    console.print(f"policy {q['policy']}: {q['waiting']} waiting. You ({you['user']}{team}): "
                  f"{you['usage_device_hours']:.2f} device-hours recently (decayed), share {you['share']:.2f}; "
                  f"{q['others_waiting']} job(s) of others waiting, {q['others_ahead']} ahead of your first.")
    for r in q["reservations"]:
        console.print(f"reservation: {r['held']} of {r['workers']} workers held"
                      + (f" for job {r['job_id']}" if r["job_id"] else " for another user's job")
                      + "".join(f", devices {','.join(map(str, d))} on {w}" for w, d in r.get("devices", {}).items())
                      + f", filled by {r['fill_by'][:19].replace('T', ' ')}"
                      + f" (a higher-priority job may use one if it ends by {r['deadline'][:19].replace('T', ' ')})")
    table = Table("#", "id", "name", "owner", "priority", "estimated start", "why it waits")
    for j in q["jobs"]:
        table.add_row(str(j["position"]), j["id"], j["name"], j["owner"], j["priority"],
                      (j["estimated_start"] or "-")[:19].replace("T", " "), j["reason"] or "starting now")
    return table


def cmd_team_set(args, client: Client) -> int:
    team = client.put_team(args.name, weight=args.weight, max_slots=args.max_slots)
    return tables.answer(team, args.json, lambda team: print(
        f"team {team['name']}: weight {team['weight']:g}, max_slots {team['max_slots']}, "
        f"members {', '.join(team['members']) or '-'}"))


def cmd_team_list(args, client: Client) -> int:
    return tables.answer(client.teams(), args.json, teams_table, to=console)


def teams_table(teams: dict) -> Table:
    from rich.table import Table

    table = Table("team", "weight", "max slots", "device-hours", "members")
    for t in teams["items"]:
        table.add_row(t["name"], f"{t['weight']:g}", str(t["max_slots"] or "-"), f"{t['usage_device_hours']:.2f}",
                      ", ".join(t["members"]))
    return table


def cmd_user_set(args, client: Client) -> int:
    fields = {k: v for k, v in (("team", args.team), ("weight", args.weight), ("max_slots", args.max_slots))
              if v is not None}
    if args.no_team:
        fields["clear_team"] = True
    if args.no_max_slots:
        fields["clear_max_slots"] = True
    if args.multinode is not None:
        fields["multinode"] = args.multinode
    return tables.answer(client.update_user(args.name, **fields), args.json, lambda user: print(
        f"user {user['name']}: team {user['team'] or '-'}, weight {user['weight']:g}, max_slots {user['max_slots']}, "
        f"multinode {'yes' if user['multinode'] else 'no'}"))


def register(sub) -> None:
    queue = sub.add_parser("queue", help="waiting jobs in the order they would start, and why each waits")
    queue.add_argument("--json", action="store_true", help="as the API returns it")
    queue.set_defaults(remote=cmd_queue)
    team = sub.add_parser("team", help="teams of the fair pool: weight and slot quota (admins set them)")
    verbs = team.add_subparsers(dest="verb", required=True)
    put = verbs.add_parser("set", help="create or change a team")
    put.add_argument("name")
    put.add_argument("--weight", type=float, default=1.0, help="its share relative to other teams (default 1)")
    put.add_argument("--max-slots", type=int, help="slots its running jobs may hold at once (default: no quota)")
    put.set_defaults(remote=cmd_team_set)
    ls = verbs.add_parser("list", help="teams, their members and recent usage")
    ls.set_defaults(remote=cmd_team_list)
    user = sub.add_parser("user", help="a user's place in the fair pool and their rights (admins)")
    uverbs = user.add_subparsers(dest="verb", required=True)
    uset = uverbs.add_parser("set", help="change a user's team, weight, quota or multinode right")
    uset.add_argument("name")
    uset.add_argument("--team")
    uset.add_argument("--no-team", action="store_true", help="leave their team")
    uset.add_argument("--weight", type=float, help="their share within their team (default 1)")
    uset.add_argument("--max-slots", type=int, help="slots their running jobs may hold at once")
    uset.add_argument("--no-max-slots", action="store_true", help="remove their quota")
    uset.add_argument("--multinode", action=argparse.BooleanOptionalAction, default=None,
                      help="grant (or --no-multinode withdraw) their right to run multi-node gangs, whose ranks share "
                      "their hosts' network")
    uset.set_defaults(remote=cmd_user_set)
    for p in (put, ls, uset):
        p.add_argument("--json", action="store_true", help="machine-readable output")
