"""The `trainjobs` command.

Client commands (status, list, submit, logs, ...) only talk HTTP through trainjobs.client, and must start fast
(in well under 0.2 s): no module the CLI imports at its top imports SQLAlchemy or the server (service.db,
service.jobs, the API), Redis, rq, torch, or even service.settings (pydantic-settings); the SDK itself (httpx)
loads once the arguments are parsed, so `trainjobs --help` does without it. What a server-side command (up,
api, worker, demo, db, gc) needs is imported inside the function that runs it. tests/test_cli_startup.py
holds the line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli import experiments as experiments_cli
from service.cli import files, ids, tables
from service.cli import gc as gc_cli
from service.cli import jobs as jobs_cli
from service.cli import joins as joins_cli
from service.cli import login as login_cli
from service.cli import pool as pool_cli
from service.cli import registry as registry_cli
from service.cli import run as run_cli
from service.cli import sweeps as sweeps_cli
from service.cli import tokens as auth_cli
from service.cli import webhooks as webhooks_cli
from service.cli.console import LazyConsole
from service.cli.follow import (
    add_output_flags,
    check_spec_rank,
    follow,
    place,
    print_outcome,
    print_retried,
    rank_number,
    submitted,
)
from trainjobs.states import TERMINAL

if TYPE_CHECKING:  # imported when a command runs (see main): `trainjobs --help` needs neither httpx nor pydantic
    from service.settings import Settings
    from trainjobs.client import Client, Connection

# What the CLI prints is mostly the user's own text (job names, error messages, logs): printed as text, never read
# as rich markup (`[rank0]: boom` stays whole, and a `[/]` in it is no crash). Styling is explicit (Text).
console = LazyConsole(markup=False)


def load_spec(path: str) -> dict:
    """A spec file, YAML or JSON; a mistake in it is one line naming the file, line and column (files.BadFile)."""
    return files.read_mapping(path)


def cmd_submit(args, client: Client) -> int:
    """Submit; with --follow, stream the job's progress and exit with its outcome (0, 1, or 130: cancelled)."""
    spec = load_spec(args.file)
    if args.follow:
        check_spec_rank(spec, args.rank)
    if args.workdir is not None:  # ship the folder: entrypoint.script (or module) is relative to it
        if not isinstance(spec.get("entrypoint"), dict):
            raise ValueError("--workdir ships your code with an entrypoint job: the spec needs an `entrypoint`")
        client.validate(spec, allow_unschedulable=args.allow_unschedulable)  # a spec refused costs no upload
        spec["entrypoint"]["package"] = run_cli.upload(client, Path(args.workdir))
    return submitted(client, client.submit(spec, allow_unschedulable=args.allow_unschedulable), args, console)


def cmd_plan(args, client: Client) -> int:
    """The memory plan of a spec: both estimates per device, against the device's memory, and the choice."""
    from rich.text import Text

    plan = client.plan(load_spec(args.file))

    def show(plan: dict) -> None:
        console.print(tables.plan_table(plan))
        console.print(Text.assemble("choice: ", (plan["choice"] or "nothing fits", "bold"), f" ({plan['reason']})"))

    tables.answer(plan, args.json, show)
    return 0 if plan["strategy"] else 1


def cmd_status(args, client: Client) -> int:
    from rich.text import Text

    job = client.get(args.job_id)
    if args.json:
        return tables.answer(job, True)
    console.print(tables.job_table(job))
    for warning in job.get("warnings") or []:  # a straggler, an idle job: what the on-call looks for first
        console.print(Text.assemble((f"warning ({warning['kind']}):", "yellow"), f" {warning['message']}"))
    if job["status"] in TERMINAL:
        print_outcome(job, console)
    else:  # a retry queued or running: why the attempts before it ended
        print_retried(job, console)
    for node in client.attempts(args.job_id)["items"]:
        if node["number"] == job["attempt"] and node["stacks"]:
            print_stacks(node, full=False)
    return 0


def print_stacks(node: dict, *, full: bool) -> None:
    stacks = node["stacks"]
    console.print(f"stacks of attempt {node['number']}, node {node['node_rank']} ({stacks['reason']}, "
                  f"{stacks['taken_at']}):")
    for rank in stacks["ranks"]:
        console.print(f"  rank {rank['rank']} (pid {rank['pid']}): {rank['where']}")
        if full:
            console.print("    " + rank["text"].rstrip().replace("\n", "\n    "))


def cmd_stacks(args, client: Client) -> int:
    def show(answer: dict) -> None:
        for node in answer["items"]:
            print_stacks(node, full=True)

    return tables.answer(client.stacks(args.job_id), args.json, show)


def cmd_workers(args, client: Client) -> int:
    """Every worker that passes the filters (the SDK follows the API's pages)."""
    labels = dict(label.split("=", 1) for label in args.label or [])
    page = client.workers(args.state, labels=labels, min_free_devices=args.free)
    return tables.answer(page, args.json, tables.workers_table, to=console)


def label_pair(text: str) -> str:
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return text


def cmd_logs(args, client: Client) -> int:
    """The output so far; with --follow, as it grows until the job ends. --json: one {"text"} object per line
    (JSON lines), or without --follow one object with the offset to resume from and the job's status."""
    node, rank = (args.node or 0, None) if args.rank is None else place(client.get(args.job_id), args.rank, args.node)
    if not args.follow:
        text, next_offset, status = client.log_page(args.job_id, node_rank=node, rank=rank)
        if not args.json:
            sys.stdout.write(text)  # the output as it is: no table, no console
            return 0
        return tables.answer({"job_id": args.job_id, "node_rank": node, "rank": rank, "text": text,
                              "next_offset": next_offset, "status": status}, True)
    for text in client.follow_logs(args.job_id, node_rank=node, rank=rank):
        sys.stdout.write(json.dumps({"text": text}) + "\n" if args.json else text)
        sys.stdout.flush()
    return 0


def cmd_db(args, settings: Settings) -> int:
    from alembic.util import CommandError

    from service import migrate
    from service.db import make_private_dir

    if args.action == "downgrade" and not args.revision:
        console.print("[red]trainjobs db downgrade needs a revision: a number such as 0016, or -1 for one step")
        return 2
    make_private_dir(settings.data_dir)  # 0700, the default SQLite file lives there
    url = settings.resolved_database_url
    try:
        if args.action == "upgrade":
            migrate.upgrade(url, args.revision or "head")
        else:
            migrate.downgrade(url, args.revision)
    except CommandError as exc:  # an unknown revision, or one on the wrong side of the current one
        console.print(f"[red]trainjobs db {args.action}: {exc}")
        return 2
    return tables.answer({"database_url": url, "revision": migrate.current(url)}, args.json,
                         lambda db: f"database at revision {db['revision']}: {db['database_url']}", to=console)


def cmd_up(args, settings: Settings) -> int:
    from service.cli import local_registry
    from service.cli.stack import Stack, run_forever
    from service.undumpable import make_undumpable

    make_undumpable()  # the ranks descend from this process: they must not read the new admin token from it
    if args.allow_entrypoints:
        settings = settings.model_copy(update={"allow_entrypoints": True})
    stack = Stack(settings, host=args.host, port=args.port, workers=args.workers, api_workers=args.api_workers,
                  registry=args.registry)
    try:
        stack.start()
    except local_registry.RegistryUnavailable as exc:
        stack.stop()
        console.print(f"trainjobs up: {exc}", soft_wrap=True)
        return 2
    except BaseException:
        stack.stop()  # never leave a half-started stack behind (say, the port was taken)
        raise
    console.print(f"trainjobs up: API {stack.api_url}, {args.workers} worker(s), "
                  f"database {settings.resolved_database_url}. Ctrl-C stops everything.")
    console.print("users' own code (trainjobs run, entrypoint specs): " + (
        "allowed, in the sandbox" if settings.allow_entrypoints else
        "off; start with `trainjobs up --allow-entrypoints` to allow it"), soft_wrap=True)
    if args.registry:
        console.print(local_registry.push_hint(args.registry), soft_wrap=True)
    if stack.new_admin_token:
        console.print(f"admin token (saved to {settings.admin_token_file}, mode 0600; the CLI reads it "
                      f"there):\n{stack.new_admin_token}", soft_wrap=True)
    console.print(connect_lines(stack.api_url, settings.admin_token_file), soft_wrap=True)
    return run_forever(stack)


def connect_lines(api_url: str, token_file: Path) -> str:
    """What `up` says about using the stack from another shell or folder: the two lines to export, or login once.
    The token is named by its file, not printed again."""
    import shlex

    file = shlex.quote(str(token_file))
    return (f"to use it from any shell or folder, run once:\n  trainjobs login {api_url} --token-file {file}\n"
            f"or export:\n  export TRAINJOBS_API_URL={api_url}\n  export TRAINJOBS_TOKEN=$(cat {file})")


def cmd_demo(args, settings: Settings) -> int:
    """Start a stack on a free port, run one job with a progress bar, print its summary, stop."""
    import socket

    from service.cli.stack import Stack
    from service.undumpable import make_undumpable
    from trainjobs.client import Client

    make_undumpable()  # as `up`
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    console.print(f"starting the stack (SQLite in {settings.data_dir}, Redis at {settings.redis_url}) ...")
    with Stack(settings, port=port, workers=1, quiet=True) as stack:
        client = Client(stack.api_url, token=stack.token)
        job = client.submit(load_spec(args.file))
        console.print(f"submitted {job['id']}: {job['spec']['strategy']} on "
                      f"{job['spec']['resources']['nproc_per_node']} processes")
        return print_outcome(follow(client, job["id"], console, exit_on_ctrl_c=False), console)


def cmd_api(args, settings: Settings) -> int:
    import uvicorn

    from service.settings import check_bind
    from service.undumpable import make_undumpable, start_resource_tracker_scrubbed

    check_bind(settings, args.host)
    # With --workers N this process is uvicorn's master and never imports service/api/asgi.py (each worker does,
    # and makes itself undumpable there); its environment holds the database URL all the same. So would the
    # resource tracker that uvicorn has exec'd (and so dumpable) with the first worker: start it now, without.
    make_undumpable()
    if args.workers > 1:
        start_resource_tracker_scrubbed()
    # NOTE: N processes, each the whole app: reads and writes scale with them; the sweeper's pass stays one at a
    # time (a Redis lock), each webhook delivery is claimed by one (a compare-and-set), and a revoked token
    # leaves every process's principal cache through the epoch in Redis.
    from service.cli.stack import KEEP_ALIVE_S

    uvicorn.run("service.api.asgi:app", host=args.host, port=args.port, workers=args.workers,
                timeout_keep_alive=KEEP_ALIVE_S)
    return 0


def cmd_worker(args, settings: Settings) -> int:
    import importlib

    # By name, so that importing service never imports worker/ (the control plane never imports torch).
    importlib.import_module("worker.main").main(burst=args.burst, slots=args.slots, device=args.device,
                                                labels=args.label, address=args.address, api=args.api,
                                                join_token=args.join_token)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainjobs", description="Run PyTorch training jobs as a service.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="API + workers (+ Redis if none is reachable) on one machine")
    up.add_argument("--host", default="127.0.0.1", help="the API's address (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="the API's port (default 8000)")
    up.add_argument("--workers", type=int, default=1,
                    help="worker processes (default 1; each runs as many jobs at once as its slots fit)")
    up.add_argument("--allow-entrypoints", action="store_true",
                    help="let jobs run their users' own code (trainjobs run, entrypoint specs), in the sandbox: "
                         "TRAINJOBS_ALLOW_ENTRYPOINTS=1")
    up.add_argument("--api-workers", type=int, default=1, choices=range(1, 65), metavar="N",
                    help="API processes (default 1)")
    up.add_argument("--registry", nargs="?", const="127.0.0.1:5000", metavar="HOST:PORT",
                    help="also serve an image registry on loopback for jobs' own images (default 127.0.0.1:5000)")
    up.set_defaults(local=cmd_up)
    api = sub.add_parser("api", help="the HTTP API")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--workers", type=int, default=1, choices=range(1, 65), metavar="N",
                     help="API processes on the one port (default 1)")
    api.set_defaults(local=cmd_api)
    worker = sub.add_parser("worker", help="a worker that runs jobs from the queues")
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    worker.add_argument("--slots", type=int, help="processes (CPU) or GPUs (CUDA) a job may use; default: detected")
    worker.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when nvidia-smi lists a GPU")
    worker.add_argument("--label", action="append", metavar="K=V", help="a label jobs select (resources.selector)")
    worker.add_argument("--address", help="how other nodes reach this one; default: the address that reaches Redis")
    worker.set_defaults(local=cmd_worker)
    demo = sub.add_parser("demo", help="start a stack, run one job end to end, stop")
    demo.add_argument("file", nargs="?", default="examples/ddp-mlp.json")
    demo.set_defaults(local=cmd_demo)
    db = sub.add_parser("db", help="database maintenance")
    db.add_argument("action", choices=["upgrade", "downgrade"])
    db.add_argument("revision", nargs="?", help="upgrade: default head; downgrade: a revision (0016) or -1. A "
                    "downgrade drops what later revisions added (their columns' data included): back up first, and "
                    "stop the API and workers (they expect head)")
    db.add_argument("--json", action="store_true", help="the database URL and revision as JSON")
    db.set_defaults(local=cmd_db)
    submit = sub.add_parser("submit", help="submit a job spec (JSON or YAML)")
    submit.add_argument("file")
    submit.add_argument("--follow", action="store_true",
                        help="stream the job's output (rank 0's; see --rank) and progress until it ends; exit 0 "
                        "succeeded, 1 failed, 130 cancelled (Ctrl-C stops following, not the job)")
    submit.add_argument("--json", action="store_true", help="the job as JSON (with --follow: once it has ended)")
    add_output_flags(submit)
    submit.add_argument("--allow-unschedulable", action="store_true",
                        help="take the job though no live worker could run it now: it waits for one")
    submit.add_argument("--workdir", metavar="DIR", help="pack and upload DIR with the job (entrypoint jobs)")
    submit.set_defaults(remote=cmd_submit)
    plan = sub.add_parser("plan", help="the memory plan of a job spec (DDP or FSDP, and why), without submitting")
    plan.add_argument("file")
    plan.add_argument("--json", action="store_true", help="the plan as the API returns it")
    plan.set_defaults(remote=cmd_plan)
    status = sub.add_parser("status", help="a job: its state, progress, why it waits, its error")
    status.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    status.add_argument("--json", action="store_true", help="the job as the API returns it")
    status.set_defaults(remote=cmd_status)
    stacks = sub.add_parser("stacks", help="every rank's stack of a running job, without stopping it (py-spy)")
    stacks.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    stacks.add_argument("--json", action="store_true", help="the attempt's nodes as the API returns them")
    stacks.set_defaults(remote=cmd_stacks)
    jobs_cli.register(sub)
    logs = sub.add_parser("logs", help="a job's combined output")
    logs.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    logs.add_argument("--follow", action="store_true", help="stream new output until the job ends")
    logs.add_argument("--json", action="store_true", help="JSON (with --follow: JSON lines)")
    logs.add_argument("--rank", type=rank_number, metavar="R", help="rank R's lines alone, unmarked, with the "
                      "lines no rank wrote (default: every rank's, each marked with its rank in a multi-rank job)")
    logs.add_argument("--node", type=rank_number, metavar="K",
                      help="node K's log, for a multi-node job (default 0, or the node of --rank)")
    logs.set_defaults(remote=cmd_logs)
    workers = sub.add_parser("workers", help="the workers: state, slots, labels, current job, last heartbeat")
    workers.add_argument("--json", action="store_true", help="the list as the API returns it")
    workers.add_argument("--state", action="append", choices=("idle", "busy", "draining", "lost"),
                         help="only workers in this state (repeatable: any of them)")
    workers.add_argument("--label", action="append", type=label_pair, metavar="K=V",
                         help="only workers with this label (repeatable: every one)")
    workers.add_argument("--free", type=int, metavar="N", help="only workers with at least N devices free")
    workers.set_defaults(remote=cmd_workers)
    run_cli.register(sub)
    experiments_cli.register(sub)
    sweeps_cli.register(sub)
    auth_cli.register(sub)
    joins_cli.register(sub)
    gc_cli.register(sub)
    pool_cli.register(sub)
    webhooks_cli.register(sub)
    registry_cli.register(sub)
    login_cli.register(sub)
    add_connection_flags(parser)
    return parser


JOB_HELP = "a job id, a unique prefix of it (4 characters or more) or the job's exact name"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """--api-url and --token on every command that calls the API (they win over the environment and the config
    file). NOTE: walks argparse's subparser actions, so that the modules that register commands need not know."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                add_connection_flags(child)
    if parser.get_default("remote") is not None:
        group = parser.add_argument_group("where the API is (else TRAINJOBS_API_URL, TRAINJOBS_TOKEN, the file "
                                          "`trainjobs login` writes)")
        group.add_argument("--api-url", metavar="URL", help="the API, e.g. http://127.0.0.1:8000")
        group.add_argument("--token", dest="api_token", metavar="TOKEN", help="the API token")


class ClientSettings:
    """Where the API is and the token to call it with, for a client command: trainjobs.client.connect, which the
    SDK's Client() uses too (flag, environment, the config file `trainjobs login` writes, the local admin token
    file, the default).

    NOTE: the environment is read as service.settings.Settings reads it (TRAINJOBS_ prefix, names in any case,
    the same defaults and the same secrets directory), without it: pydantic-settings alone takes longer to
    import than the rest of a client command's start. tests/test_cli_startup.py compares the two. A client
    command is thus no longer refused for a server-side setting it does not use.
    """

    @staticmethod
    def from_env(environ=None, *, api_url: str | None = None, token: str | None = None) -> Connection:
        from trainjobs.client import connect

        return connect(api_url, token, environ=environ, url_flag="--api-url", token_flag="--token")


def import_httpx():
    """httpx, without its own command line. NOTE: httpx's __init__ imports httpx._main (click, pygments,
    rich.syntax: about 30 ms, a fifth of a client command's start) inside a try that falls back to a stub
    when those are not installed; a None in sys.modules makes that import fail the same way. The CLI never
    runs httpx's command line. An httpx that no longer tolerates it is imported as it is."""
    if "httpx" in sys.modules:
        return sys.modules["httpx"]
    sys.modules["httpx._main"] = None
    try:
        import httpx
    except ImportError:
        httpx = None
    finally:
        del sys.modules["httpx._main"]
    if httpx is None:
        import httpx
    return httpx


def main(argv: list[str] | None = None, client: Client | None = None) -> int:
    """The command line's exit code. `client`: the SDK client a client command uses (tests hand one on an app),
    instead of one made from the settings."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # `trainjobs` alone: what it can do, and no error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    import logging  # here: `trainjobs --help` and a bad argument need none of it (nor httpx, which imports it)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The SDK and its HTTP client, for every command that runs (the except clauses below name them).
    httpx = import_httpx()
    from trainjobs.client import APIError, Client

    remote = hasattr(args, "remote")
    settings = None
    try:
        if hasattr(args, "configure"):  # login, logout: the config file itself
            return args.configure(args)
        if remote:
            settings = ClientSettings.from_env(api_url=args.api_url, token=args.api_token)
            client = client or Client(connection=settings)
            if getattr(args, "job_id", None):  # a prefix or a name: the one job it names
                args.job_id = ids.resolve(client, args.job_id)
            if getattr(args, "sweep_id", None):
                args.sweep_id = ids.resolve_sweep(client, args.sweep_id)
            return args.remote(args, client)
        from service.settings import get_settings  # a server-side command: the whole settings, imported only now

        settings = get_settings()
        return args.local(args, settings)
    except APIError as exc:
        print_error(str(exc))
        return 2
    except httpx.TransportError as exc:
        where = "its URL" if settings is None else settings.api_url + (f" (from {settings.url_from})" if remote else "")
        print_error(f"cannot reach the API at {where} ({exc}); is `trainjobs up` running? Started with --port N: "
                    "`trainjobs login http://127.0.0.1:N --token-file trainjobs-data-secrets/admin.token`, or set "
                    "TRAINJOBS_API_URL")
        return 2
    except (OSError, ValueError, RuntimeError) as exc:
        print_error(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130


def print_error(message: str) -> None:
    """`error:` in red, then the message as text (often the user's own: never read as markup)."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), f" {message}"), soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
