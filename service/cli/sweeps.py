"""Sweeps from the command line: `trainjobs sweep FILE [--follow]`, `trainjobs sweeps`, `trainjobs sweep-status ID`
(the trials table, best first), `trainjobs sweep-cancel ID`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.table import Table

    from trainjobs.client import Client

console = LazyConsole(markup=False)
FOLLOW_POLL_S = 2.0
SWEEP_HELP = "a sweep id, a unique prefix of it (4 characters or more) or the sweep's exact name"


def load(path: str) -> dict:
    """YAML (.yaml, .yml) or JSON, by the file's name, as `submit` reads a spec: a mistake is one line."""
    from service.cli.files import read_mapping

    return read_mapping(path, "sweep")


def value(v) -> str:
    return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def sweep_line(sweep: dict) -> str:
    t, best = sweep["trials"], sweep["best"]
    ended = t["succeeded"] + t["failed"] + t["cancelled"] + t["stopped_early"]
    line = (f"sweep {sweep['id']} ({sweep['name']}): {sweep['status']}, {ended}/{t['total']} trials ended "
            f"({t['succeeded']} succeeded, {t['stopped_early']} stopped early, {t['failed']} failed, "
            f"{t['cancelled']} cancelled)")
    if best:
        line += f"; best {sweep['metric']['name']} {value(best['best'])}: trial {best['index']} {best['params']}"
    return line + (f"; error: {sweep['error']}" if sweep["error"] else "")


def trials_table(sweep: dict, trials: list[dict]) -> Table:
    """One row a trial, best first by the sweep's metric (trials with no value yet last)."""
    from rich.table import Column, Table

    metric, goal = sweep["metric"]["name"], sweep["metric"]["goal"]
    paths = list(sweep["parameters"])
    table = Table(Column("#", justify="right"), Column("job", no_wrap=True), "status", *paths,
                  Column("steps", justify="right"), Column(f"{metric} last", justify="right"),
                  Column(f"{metric} best", justify="right"), title=sweep_line(sweep))
    sign = 1 if goal == "minimize" else -1
    for t in sorted(trials, key=lambda t: (t["best"] is None, sign * (t["best"] or 0), t["index"])):
        status = t["reason"] or t["status"]
        table.add_row(str(t["index"]), t["job_id"], status, *(value(t["params"].get(p)) for p in paths),
                      str(t["steps"]), value(t["last"]), value(t["best"]))
    return table


def cmd_sweep(args, client: Client) -> int:
    sweep = client.submit_sweep(load(args.file))
    if not args.follow:
        return tables.answer(sweep, args.json, lambda sweep: f"submitted sweep {sweep['id']} ({sweep['name']}): "
                             f"{sweep['trials']['total']} trials, {sweep['parallel']} at a time", to=console)
    last = None
    while sweep["status"] == "running":
        if not args.json and (line := sweep_line(sweep)) != last:
            console.print(line)
            last = line
        time.sleep(FOLLOW_POLL_S)
        sweep = client.sweep(sweep["id"])
    return show(client, sweep, as_json=args.json)


def show(client: Client, sweep: dict, *, as_json: bool) -> int:
    trials = client.trials(sweep["id"])
    tables.answer({**sweep, "trial_rows": trials}, as_json, lambda _: trials_table(sweep, trials), to=console)
    return 0 if sweep["status"] in ("running", "succeeded") else 1


def cmd_sweep_status(args, client: Client) -> int:
    return show(client, client.sweep(args.sweep_id), as_json=args.json)


def cmd_sweeps(args, client: Client) -> int:
    return tables.answer(client.sweeps(status=args.status, limit=args.limit), args.json, sweeps_table, to=console)


def sweeps_table(page: dict) -> Table:
    from rich.table import Column, Table

    table = Table(Column("id", no_wrap=True), "name", "owner", "status", "method", "trials", "best",
                  Column("created (UTC)", no_wrap=True))
    for s in page["items"]:
        t, best = s["trials"], s["best"]
        table.add_row(s["id"], s["name"], s["owner"], s["status"], s["method"], f"{t['made']}/{t['total']}",
                      f"{s['metric']['name']} {value(best['best'])}" if best else "",
                      s["created_at"][:16].replace("T", " "))
    return table


def cmd_sweep_cancel(args, client: Client) -> int:
    return tables.answer(client.cancel_sweep(args.sweep_id), args.json, sweep_line, to=console)


def register(sub) -> None:
    sweep = sub.add_parser("sweep", help="submit a sweep (YAML or JSON: name, spec, parameters, method, ...)")
    sweep.add_argument("file")
    sweep.add_argument("--follow", action="store_true", help="report progress until it ends, then the trials")
    sweep.add_argument("--json", action="store_true", help="the sweep as JSON (with --follow: once it has ended)")
    sweep.set_defaults(remote=cmd_sweep)
    status = sub.add_parser("sweep-status", help="a sweep and its trials, best first by its metric")
    status.add_argument("sweep_id", metavar="SWEEP", help=SWEEP_HELP)
    status.add_argument("--json", action="store_true", help="the sweep, with its trials as trial_rows")
    status.set_defaults(remote=cmd_sweep_status)
    ls = sub.add_parser("sweeps", help="recent sweeps, newest first")
    ls.add_argument("--status", choices=["running", "succeeded", "cancelled", "failed"])
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true", help="the page as the API returns it")
    ls.set_defaults(remote=cmd_sweeps)
    cancel = sub.add_parser("sweep-cancel", help="cancel a sweep and every trial not yet ended")
    cancel.add_argument("sweep_id", metavar="SWEEP", help=SWEEP_HELP)
    cancel.add_argument("--json", action="store_true", help="the sweep as JSON")
    cancel.set_defaults(remote=cmd_sweep_cancel)
