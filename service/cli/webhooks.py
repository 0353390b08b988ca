"""`trainjobs webhooks create|list|delete|deliveries|test`: webhooks through the API (trainjobs.Client)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.table import Table

    from trainjobs.client import Client

out, err = LazyConsole(markup=False), LazyConsole(stderr=True, markup=False)  # URLs and answers are the user's text
# NOTE: a copy of service.webhooks.outbox.EVENTS, which lives beside the outbox's SQLAlchemy queries: importing
# it would load SQLAlchemy into every CLI command. tests/test_cli_startup.py checks that the two agree.
EVENTS = ("job.started", "job.succeeded", "job.failed", "job.cancelled", "job.hung", "job.preempted")


def cmd_create(args, client: Client) -> int:
    fields = {"events": args.event, "secret": args.secret, "format": args.format,
              "all_users": True if args.all_users else None}
    made = client.create_webhook(args.url, **{k: v for k, v in fields.items() if v is not None})
    return tables.answer(made, args.json, show_secret)


def show_secret(made: dict) -> None:
    print(made["secret"])  # alone on stdout: SECRET=$(trainjobs webhooks create URL)
    err.print(f"webhook {made['id']} → {made['url']} for {', '.join(made['events'])} ({made['format']}"
              f"{', every user' if made['all_users'] else ''}). The secret is shown only now.")


def cmd_list(args, client: Client) -> int:
    return tables.answer(client.webhooks(owner=args.owner), args.json, webhooks_table, to=out)


def webhooks_table(page: dict) -> Table:
    from rich.table import Column, Table

    table = Table(Column("id", no_wrap=True), "url", "events", "format", "owner", "secret", "created")
    for h in page["items"]:
        owner = h["owner"] + (" (all users)" if h["all_users"] else "")
        table.add_row(h["id"], h["url"], ", ".join(h["events"]), h["format"], owner, h["secret_hint"],
                      h["created_at"])
    return table


def cmd_delete(args, client: Client) -> int:
    return tables.answer(client.delete_webhook(args.webhook_id), args.json, lambda gone: (
        f"webhook {gone['id']} ({gone['url']}) deleted; its undelivered events are dropped"), to=err)


def cmd_deliveries(args, client: Client) -> int:
    page = client.webhook_deliveries(args.webhook_id, status=args.status, limit=args.limit)
    return tables.answer(page, args.json, deliveries_table, to=out)


def deliveries_table(page: dict) -> Table:
    from rich.table import Column, Table

    table = Table(Column("event id", no_wrap=True), "event", "subject", "status", "tries", "last answer", "next try",
                  "created")
    for d in page["items"]:
        answer = str(d["last_status_code"]) if d["last_status_code"] is not None else (d["last_error"] or "")
        table.add_row(d["event_id"], d["event"], d["subject"], d["status"], str(d["attempts"]), answer[:60],
                      d["next_attempt_at"] or "", d["created_at"])
    return table


def cmd_test(args, client: Client) -> int:
    sent = client.test_webhook(args.webhook_id)
    tables.answer(sent, args.json, lambda sent: f"{sent['event_id']}: {sent['status']} ("
                  f"{sent['last_status_code'] if sent['last_status_code'] is not None else sent['last_error']})",
                  to=out)
    return 0 if sent["status"] == "delivered" else 1


def register(sub) -> None:
    hooks = sub.add_parser("webhooks", help="webhooks: create, list, delete, deliveries, test")
    verbs = hooks.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="a webhook for your jobs' events; prints its secret alone on stdout")
    create.add_argument("url")
    create.add_argument("--event", action="append", choices=EVENTS, help="repeat for several; default: every event")
    create.add_argument("--secret", help="the signing secret (16+ characters); default: one made for you")
    create.add_argument("--format", choices=["json", "slack"], help="slack: a Slack incoming-webhook body")
    create.add_argument("--all-users", action="store_true", help="admins: every user's jobs")
    create.set_defaults(remote=cmd_create)
    ls = verbs.add_parser("list", help="your webhooks (admins: --owner someone's); never the secrets")
    ls.add_argument("--owner")
    ls.set_defaults(remote=cmd_list)
    delete = verbs.add_parser("delete", help="delete a webhook (its undelivered events too)")
    delete.add_argument("webhook_id")
    delete.set_defaults(remote=cmd_delete)
    deliveries = verbs.add_parser("deliveries", help="a webhook's deliveries, newest first")
    deliveries.add_argument("webhook_id")
    deliveries.add_argument("--status", choices=["pending", "delivered", "given_up"])
    deliveries.add_argument("--limit", type=int, default=50)
    deliveries.set_defaults(remote=cmd_deliveries)
    test = verbs.add_parser("test", help="send a webhook.test event now; exit 0 if delivered, 1 if not")
    test.add_argument("webhook_id")
    test.set_defaults(remote=cmd_test)
    for p in (create, ls, delete, deliveries, test):
        p.add_argument("--json", action="store_true", help="machine-readable output")
