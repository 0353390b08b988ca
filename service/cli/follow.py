"""`--follow`: a job's progress bar, fed by its event stream, and the job's outcome as an exit code."""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import timedelta
from itertools import chain
from typing import TYPE_CHECKING

from service.cli.console import LazyConsole, real

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from rich.console import Console

    from trainjobs.client import Client, Event

# What `trainjobs submit --follow` exits with, like a command that ran the job itself: 130 is a shell's code
# for "stopped by SIGINT", also what Ctrl-C of the follower gives (the job keeps running then).
EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 130}
SPEED_METRICS = (("tokens_per_s", "tok/s"), ("samples_per_s", "samples/s"))  # the first a job reports wins


def exit_code(job: dict) -> int:
    return EXIT_CODES.get(job["status"], 1)


def format_speed(value: float, unit: str) -> str:
    return f"{value / 1000:.1f}k {unit}" if value >= 10_000 else f"{value:.0f} {unit}"


class ProgressView:
    """What the bar shows, kept up to date from events: step / total, status, loss, throughput, ETA."""

    def __init__(self, job: dict):
        progress = job["progress"]
        self.status, self.step, self.total = job["status"], progress["step"], progress["total_steps"]
        self.pending_reason: str | None = job.get("pending_reason")  # why it waits; starting: what it does
        self.eta_s: float | None = progress.get("eta_s")
        self.latest: dict[str, float] = {}  # the last value of each metric

    def apply(self, event: Event) -> None:
        if event.kind == "status":
            self.status = event.data["status"]
            self.pending_reason = event.data.get("pending_reason")
        elif event.kind == "progress":
            self.step = event.data.get("step", self.step)
            self.total = event.data.get("total_steps", self.total)
            self.eta_s = event.data.get("eta_s")
        elif event.kind == "metrics":
            for series in event.data["series"]:
                if series["values"]:
                    self.latest[series["name"]] = series["values"][-1]

    def fields(self) -> dict:
        speed = next((format_speed(self.latest[name], unit) for name, unit in SPEED_METRICS if name in self.latest),
                     "")
        loss = f"loss {self.latest['loss']:.4f}" if "loss" in self.latest else ""
        eta = f"eta {timedelta(seconds=round(self.eta_s))}" if self.eta_s is not None and self.status == "running" \
            else ""
        status = f"{self.status}: {self.pending_reason}" if self.pending_reason else self.status  # queued, starting
        return {"completed": self.step, "total": self.total, "steps": f"{self.step}/{self.total or '?'}",
                "status": status, "loss": loss, "speed": speed, "eta": eta}


def follow(client: Client, job_id: str, console: Console | LazyConsole | None = None, *,
           exit_on_ctrl_c: bool = True, output: bool = False, node_rank: int = 0, rank: int | None = None) -> dict:
    """Follow the job's event stream to its end, with a progress bar on `console` (none without one) and, with
    `output`, the job's output (node `node_rank`'s; with `rank`, that rank's lines) printed above it as it comes;
    returns the final job. Ctrl-C stops the following only: the job runs on, and the follower exits 130 at once.

    NOTE: at once, from the signal handler, not by a KeyboardInterrupt: one raised while the progress bar's
    refresh thread holds its lock left that lock taken, and the bar's exit waited on it forever.
    exit_on_ctrl_c False (`demo`, which must stop its stack): a KeyboardInterrupt, as Python raises it.
    """
    def stop(_signum, _frame):
        if console is not None:
            console.show_cursor(True)
        sys.stdout.flush()
        LazyConsole(stderr=True, markup=False).print(f"stopped following job {job_id}; it keeps running "
                                                 f"(`trainjobs cancel {job_id}` stops it)")
        sys.stderr.flush()
        os._exit(130)

    def run() -> dict:
        return follow_events(client, job_id, console, output=output, node_rank=node_rank, rank=rank)

    if not exit_on_ctrl_c or threading.current_thread() is not threading.main_thread():  # (no handler there)
        return run()
    previous = signal.signal(signal.SIGINT, stop)
    try:
        return run()
    finally:
        signal.signal(signal.SIGINT, previous)


def follow_events(client: Client, job_id: str, console: Console | LazyConsole | None, *, output: bool = False,
                  node_rank: int = 0, rank: int | None = None) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.text import Text

    job = client.get(job_id)
    view = ProgressView(job)
    # The bar shows the latest values: points written from now on, never the series' history.
    if console is None:
        for event in client.follow_events(job_id, metrics="new"):
            view.apply(event)
        return client.get(job_id)
    columns = (TextColumn("{task.description}", style="bold", markup=False),  # the job's name, as text
               BarColumn(), TextColumn("{task.fields[steps]}"), TextColumn("{task.fields[status]}"),
               TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[eta]}"))
    offset = 0  # of the output printed so far
    # Not a terminal (CI logs, a file, a pipe): no live bar is drawn, so each change of status (and of why a queued
    # job waits) is a line of its own.
    plain, said = not console.is_terminal, None
    with Progress(*columns, console=real(console), transient=False) as bar:
        task = bar.add_task(job["name"], **view.fields())
        # NOTE: event by event, as they come (rich flushes each print, to a pipe too): a list of the stream, as once,
        # waited for the job's end.
        for event in chain([None], client.follow_events(job_id, metrics="new")):
            if event is not None:
                view.apply(event)
            if output and event is not None and (
                    event.kind == "logs" or (event.kind == "status" and event.data["status"] in EXIT_CODES)):
                offset = print_output(client, job_id, offset, bar.console, node_rank=node_rank, rank=rank)
            fields = view.fields()
            bar.update(task, **fields)
            if plain and fields["status"] != said:
                said = fields["status"]
                bar.console.print(Text(f"{job['name']} {job_id}: {fields['steps']} {said}"), soft_wrap=True)
    return client.get(job_id)


def submitted(client: Client, job: dict, args, console: Console | LazyConsole, note: str = "") -> int:
    """How submit, run and resubmit end: the job (--json), or a line naming it (and `note`); with --follow, the
    job followed to its end (its output too, unless --quiet), its outcome, and the outcome's exit code."""
    from service.cli.tables import answer

    if not args.follow:
        return answer(job, args.json, lambda job: f"submitted {job['id']} ({job['name']}){note}", to=console)
    if args.json:  # the finished job, once it has ended
        job = follow(client, job["id"])
        answer(job, True)
        return exit_code(job)
    console.print(f"submitted {job['id']} ({job['name']}){note}")
    rank, node = getattr(args, "rank", None), getattr(args, "node", None)
    node_rank, rank = place(job, 0 if rank is None and node is None else rank, node)  # rank 0 unless told
    followed = follow(client, job["id"], console, output=not getattr(args, "quiet", False), node_rank=node_rank,
                      rank=rank)
    return print_outcome(followed, console)


def add_output_flags(parser) -> None:
    """What `submit --follow` and `run --follow` print of the job's output."""
    parser.add_argument("--quiet", action="store_true", help="with --follow: the progress bar alone, not the output")
    parser.add_argument("--rank", type=rank_number, metavar="R",
                        help="with --follow: rank R's output (default: rank 0's), with the lines no rank wrote "
                        "(torchrun's own)")
    parser.add_argument("--node", type=rank_number, metavar="K",
                        help="with --follow: node K's output; alone, every rank's lines of it, each marked with "
                        "its rank (default: the node of --rank)")


def rank_number(text: str) -> int:
    """An argparse type: a rank or node number, 0 or more."""
    import argparse

    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number 0 or more")
    return int(text)


def check_rank(rank: int | None, *, nnodes: int, nproc_per_node: int, job: str) -> None:
    """A --rank the job has, or a ValueError naming --rank and the job's world size."""
    world = nnodes * nproc_per_node
    if rank is not None and rank >= world:
        raise ValueError(f"--rank {rank}: {job} has world size {world} ({nnodes} node(s) × {nproc_per_node} "
                         f"process(es)): its ranks are 0 to {world - 1}")


def check_spec_rank(spec: dict, rank: int | None) -> None:
    """Refuse --rank R of a job that would have no rank R before it is submitted (a spec the API would refuse is
    left to its answer, which names the field)."""
    if rank is None:
        return
    from pydantic import ValidationError

    from trainjobs.spec import JobSpec

    try:
        resources = JobSpec.model_validate(spec).resources
    except ValidationError:
        return
    check_rank(rank, nnodes=resources.nnodes, nproc_per_node=resources.nproc_per_node, job="the job")


def place(job: dict, rank: int | None, node: int | None) -> tuple[int, int | None]:
    """The node whose log to read and the rank whose lines to keep (None: every line, marked).

    --rank R: node R // nproc_per_node unless --node says otherwise. NOTE: a gang's nodes are numbered by c10d's
    rendezvous, not by the service (worker/launch.py), so rank R may run on another node: --node then finds it.
    A job of one rank marks no line, so its whole log is that rank's: no filter (nor its wait for a line's end).
    """
    resources = job["spec"]["resources"]
    nnodes, nproc = resources["nnodes"], resources["nproc_per_node"]
    check_rank(rank, nnodes=nnodes, nproc_per_node=nproc, job=f"job {job['id']}")
    if node is None:
        node = 0 if rank is None else rank // nproc
    return node, rank if nnodes * nproc > 1 else None


def print_output(client: Client, job_id: str, offset: int, console: Console | LazyConsole, *, node_rank: int = 0,
                 rank: int | None = None) -> int:
    """The job's output from `offset` on (the user's text, printed as text, above the bar); the next offset."""
    from rich.text import Text

    while True:
        text, after, _ = client.log_page(job_id, offset, node_rank=node_rank, rank=rank)
        if text:
            console.print(Text(text), end="", soft_wrap=True)
        if after == offset or not text:
            return after
        offset = after


def print_outcome(job: dict, console: Console | LazyConsole) -> int:
    """The job's final status, summary and error, then earlier attempts' errors, each labelled as retried (the
    user's text, printed as text); returns its exit code."""
    from rich.table import Table
    from rich.text import Text

    style = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(job["status"], "white")
    attempt = job.get("attempt") or 1
    console.print(Text.assemble("job ", (job["id"], "bold"), " ", (job["status"], style),
                                f" on attempt {attempt}" if attempt > 1 else ""))
    if job.get("summary"):
        table = Table("metric", "value", title="summary")
        for key, value in job["summary"].items():
            shown = f"{value:.6g}" if isinstance(value, float) else "-" if value is None else str(value)
            table.add_row(Text(key), Text(shown))
        console.print(table)
    if err := final_error(job):
        rank = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        console.print(Text(f"{err.get('type')}{rank}: {err.get('message')}", style="red"))
        if frames := last_lines(err.get("traceback") or err.get("excerpt") or "", TRACEBACK_LINES):
            console.print(Text(frames))
    print_retried(job, console)
    return exit_code(job)


def final_error(job: dict) -> dict | None:
    """The error that ended the job: None where it succeeded, or where the error kept is an earlier attempt's (a
    job cancelled while its retry ran)."""
    err = job.get("error")
    if not err or job["status"] == "succeeded":
        return None
    causes = err.get("attempts") or []
    return err if not causes or causes[-1].get("attempt") == (job.get("attempt") or 1) else None


def print_retried(job: dict, console: Console | LazyConsole) -> None:
    """One line per earlier attempt that failed and was retried: `attempt 1 (retried): RuntimeError: ...`."""
    from rich.text import Text

    err, attempt = job.get("error") or {}, job.get("attempt") or 1
    causes = [(f"attempt {c['attempt']}", c) for c in err.get("attempts") or [] if (c.get("attempt") or 0) < attempt]
    if err and not err.get("attempts") and final_error(job) is None:  # an error kept without its history
        causes = [("an earlier attempt", err)]
    for label, cause in causes:
        console.print(Text(f"{label} (retried): {cause.get('type')}: {cause.get('message')}", style="yellow"))


TRACEBACK_LINES = 12  # of a failed rank's traceback (or, without one, of its output) under the error


def last_lines(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])
