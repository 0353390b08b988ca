"""The `trainjobs` command."""

import argparse
import json
import logging
import socket
import sys
import time
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from service.client import APIError, Client
from service.jobs.status import TERMINAL, JobStatus
from service.settings import Settings, get_settings

console = Console()


def load_spec(path: str) -> dict:
    text = Path(path).read_text()
    return yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)


def follow(client: Client, job_id: str) -> dict:
    """A progress bar until the job ends; returns the final job."""
    job = client.get(job_id)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[info]}"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(job["name"], total=job["progress"]["total_steps"], info=job["status"])
        while job["status"] not in TERMINAL:
            time.sleep(0.5)
            job = client.get(job_id)
            info = job["status"]
            if job["status"] == "running":
                loss = client.metrics(job_id, "loss")["series"]
                if loss and loss[0]["values"]:
                    info = f"loss {loss[0]['values'][-1]:.4f}"
            bar.update(task, completed=job["progress"]["step"], total=job["progress"]["total_steps"], info=info)
    return job


def print_outcome(job: dict) -> int:
    style = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(job["status"], "white")
    console.print(f"job [bold]{job['id']}[/] [{style}]{job['status']}[/]")
    if job.get("summary"):
        table = Table("metric", "value", title="summary")
        for key, value in job["summary"].items():
            table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
        console.print(table)
    if job.get("error"):
        err = job["error"]
        rank = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        console.print(f"[red]{err.get('type')}{rank}: {err.get('message')}[/]")
    return 0 if job["status"] == "succeeded" else 1


def cmd_submit(args, client: Client) -> int:
    job = client.submit(load_spec(args.file))
    console.print(f"submitted {job['id']} ({job['name']})")
    if not args.follow:
        return 0
    return print_outcome(follow(client, job["id"]))


def cmd_plan(args, client: Client) -> int:
    """The memory plan of a spec: both estimates per device, against the device's memory, and the choice."""
    plan = client.plan(load_spec(args.file))
    table = Table("per device", "ddp", "fsdp", title=f"{plan['parameters']:,} parameters on {plan['device']}")
    for key in dict.fromkeys([*plan["ddp"]["breakdown"], *plan["fsdp"]["breakdown"]]):
        row = [plan[s]["breakdown"].get(key) for s in ("ddp", "fsdp")]
        table.add_row(key, *("" if v is None else f"{v / 2**30:.3f} GiB" for v in row))
    table.add_row("[bold]total", *(f"[bold]{plan[s]['total_gib']:.3f} GiB" for s in ("ddp", "fsdp")))
    console.print(table)
    console.print(f"choice: [bold]{plan['choice'] or 'nothing fits'}[/] ({plan['reason']})")
    return 0 if plan["strategy"] else 1


def print_json(data) -> int:
    """Plain JSON on stdout (no rich markup), for scripts and jq."""
    print(json.dumps(data, indent=2))
    return 0


def cmd_status(args, client: Client) -> int:
    job = client.get(args.job_id)
    if args.json:
        return print_json(job)
    progress = job["progress"]
    table = Table(show_header=False, title=f"job {job['id']}")
    for key, value in (("name", job["name"]), ("status", job["status"]), ("priority", job["priority"]),
                       ("attempt", f"{job['attempt']} (max retries {job['max_retries']})"),
                       ("step", f"{progress['step']}/{progress['total_steps'] or '?'}"),
                       ("eta", f"{progress['eta_s']:.0f} s" if progress.get("eta_s") is not None else ""),
                       ("created", job["created_at"]), ("started", job["started_at"] or ""),
                       ("finished", job["finished_at"] or "")):
        table.add_row(key, str(value))
    console.print(table)
    if job["status"] in TERMINAL:
        print_outcome(job)
    return 0


def cmd_list(args, client: Client) -> int:
    page = client.list(status=args.status, limit=args.limit)
    if args.json:
        return print_json(page)
    table = Table("id", "name", "status", "step", "created")
    for job in page["items"]:
        progress = job["progress"]
        table.add_row(job["id"], job["name"], job["status"], f"{progress['step']}/{progress['total_steps'] or '?'}",
                      job["created_at"])
    console.print(table)
    return 0


def cmd_logs(args, client: Client) -> int:
    if args.follow:
        for text in client.follow_logs(args.job_id):
            sys.stdout.write(text)
            sys.stdout.flush()
    else:
        sys.stdout.write(client.logs(args.job_id)[0])
    return 0


def cmd_cancel(args, client: Client) -> int:
    job = client.cancel(args.job_id)
    console.print(f"job {job['id']}: {job['status']}" + (" (cancel requested)" if job["status"] not in TERMINAL
                                                         else ""))
    return 0


def cmd_db(args, settings: Settings) -> int:
    from service import migrate

    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the default SQLite file lives there
    migrate.upgrade(settings.resolved_database_url)
    console.print(f"database at head: {settings.resolved_database_url}")
    return 0


def cmd_up(args, settings: Settings) -> int:
    from service.stack import Stack, run_forever

    stack = Stack(settings, host=args.host, port=args.port, workers=args.workers)
    try:
        stack.start()
    except BaseException:
        stack.stop()  # never leave a half-started stack behind (say, the port was taken)
        raise
    console.print(f"trainjobs up: API {stack.api_url}, {args.workers} worker(s), "
                  f"database {settings.resolved_database_url}. Ctrl-C stops everything.")
    return run_forever(stack)


def cmd_demo(args, settings: Settings) -> int:
    """Start a stack on a free port, run one job with a progress bar, print its summary, stop."""
    from service.stack import Stack

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    console.print(f"starting the stack (SQLite in {settings.data_dir}, Redis at {settings.redis_url}) ...")
    with Stack(settings, port=port, workers=1, quiet=True) as stack:
        client = Client(stack.api_url)
        job = client.submit(load_spec(args.file))
        console.print(f"submitted {job['id']}: {job['spec']['strategy']} on "
                      f"{job['spec']['resources']['nproc_per_node']} processes")
        return print_outcome(follow(client, job["id"]))


def cmd_api(args, settings: Settings) -> int:
    import uvicorn

    uvicorn.run("service.app:app", host=args.host, port=args.port)
    return 0


def cmd_worker(args, settings: Settings) -> int:
    import importlib

    # By name, so that importing service never imports worker/ (DESIGN rule 2).
    importlib.import_module("worker.main").main(burst=args.burst)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainjobs", description="Run PyTorch training jobs as a service.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="API + workers (+ Redis if none is reachable) on one machine")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1)
    up.set_defaults(local=cmd_up)
    api = sub.add_parser("api", help="the HTTP API")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.set_defaults(local=cmd_api)
    worker = sub.add_parser("worker", help="a worker that runs jobs from the queues")
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    worker.set_defaults(local=cmd_worker)
    demo = sub.add_parser("demo", help="start a stack, run one job end to end, stop")
    demo.add_argument("file", nargs="?", default="examples/ddp-mlp.json")
    demo.set_defaults(local=cmd_demo)
    db = sub.add_parser("db", help="database maintenance")
    db.add_argument("action", choices=["upgrade"])
    db.set_defaults(local=cmd_db)
    submit = sub.add_parser("submit", help="submit a job spec (JSON or YAML)")
    submit.add_argument("file")
    submit.add_argument("--follow", action="store_true", help="show progress until the job ends")
    submit.set_defaults(remote=cmd_submit)
    plan = sub.add_parser("plan", help="the memory plan of a job spec (DDP or FSDP, and why), without submitting")
    plan.add_argument("file")
    plan.set_defaults(remote=cmd_plan)
    for name, fn in (("status", cmd_status), ("cancel", cmd_cancel)):
        p = sub.add_parser(name, help=f"{name} of a job")
        p.add_argument("job_id")
        p.set_defaults(remote=fn)
        if name == "status":
            p.add_argument("--json", action="store_true", help="the job as the API returns it")
    ls = sub.add_parser("list", help="recent jobs, newest first")
    ls.add_argument("--status", choices=[s.value for s in JobStatus])
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true", help="the page as the API returns it")
    ls.set_defaults(remote=cmd_list)
    logs = sub.add_parser("logs", help="a job's combined output")
    logs.add_argument("job_id")
    logs.add_argument("--follow", action="store_true")
    logs.set_defaults(remote=cmd_logs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    try:
        if hasattr(args, "remote"):
            return args.remote(args, Client(settings.api_url))
        return args.local(args, settings)
    except APIError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    except httpx.TransportError as exc:
        console.print(f"[red]error:[/] cannot reach the API at {settings.api_url} ({exc}); is `trainjobs up` running?")
        return 2
    except (OSError, ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
