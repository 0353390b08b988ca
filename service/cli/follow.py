"""`--follow`: a job's progress bar, fed by its event stream, and the job's outcome as an exit code."""

import os
import signal
import sys
import threading
from datetime import timedelta

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

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
        self.eta_s: float | None = progress.get("eta_s")
        self.latest: dict[str, float] = {}  # the last value of each metric

    def apply(self, event: Event) -> None:
        if event.kind == "status":
            self.status = event.data["status"]
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
        return {"completed": self.step, "total": self.total, "steps": f"{self.step}/{self.total or '?'}",
                "status": self.status, "loss": loss, "speed": speed, "eta": eta}


def follow(client: Client, job_id: str, console: Console | None = None, *, exit_on_ctrl_c: bool = True) -> dict:
    """Follow the job's event stream to its end, with a progress bar on `console` (none without one); returns
    the final job. Ctrl-C stops the following only: the job runs on, and the follower exits 130 at once.

    NOTE: at once, from the signal handler, not by a KeyboardInterrupt: one raised while the progress bar's
    refresh thread holds its lock left that lock taken, and the bar's exit waited on it forever.
    exit_on_ctrl_c False (`demo`, which must stop its stack): a KeyboardInterrupt, as Python raises it.
    """
    def stop(_signum, _frame):
        if console is not None:
            console.show_cursor(True)
        sys.stdout.flush()
        Console(stderr=True, markup=False).print(f"stopped following job {job_id}; it keeps running "
                                                 f"(`trainjobs cancel {job_id}` stops it)")
        sys.stderr.flush()
        os._exit(130)

    if not exit_on_ctrl_c or threading.current_thread() is not threading.main_thread():  # (no handler there)
        return follow_events(client, job_id, console)
    previous = signal.signal(signal.SIGINT, stop)
    try:
        return follow_events(client, job_id, console)
    finally:
        signal.signal(signal.SIGINT, previous)


def follow_events(client: Client, job_id: str, console: Console | None) -> dict:
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
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(job["name"], **view.fields())
        for event in client.follow_events(job_id, metrics="new"):
            view.apply(event)
            bar.update(task, **view.fields())
    return client.get(job_id)


def print_outcome(job: dict, console: Console) -> int:
    """The job's final status, summary and error (the user's text, printed as text); returns its exit code."""
    style = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(job["status"], "white")
    console.print(Text.assemble("job ", (job["id"], "bold"), " ", (job["status"], style)))
    if job.get("summary"):
        table = Table("metric", "value", title="summary")
        for key, value in job["summary"].items():
            table.add_row(Text(key), Text(f"{value:.6g}" if isinstance(value, float) else str(value)))
        console.print(table)
    if job.get("error"):
        err = job["error"]
        rank = f" on rank {err['rank']}" if err.get("rank") is not None else ""
        console.print(Text(f"{err.get('type')}{rank}: {err.get('message')}", style="red"))
    return exit_code(job)
