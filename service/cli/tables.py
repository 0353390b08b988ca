"""How the CLI shows what the API answers: `--json` prints the answer as it came (`answer`, the one place every
command ends in), else a rich table or plain lines for a person (a memory plan, a job, a page of jobs, the
workers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from service.cli.console import LazyConsole

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

# What the CLI prints is mostly the user's own text (names, messages, URLs): printed as text, never read as markup.
console = LazyConsole(markup=False)


def answer(data: Any, as_json: bool, show: Callable[[Any], Any] | None = None, *,
           to: Console | LazyConsole | None = None, indent: int | None = 2) -> int:
    """A command's ending: with --json, `data` as plain JSON on stdout (no rich markup: for scripts and jq); else
    what `show(data)` makes of it for a person, printed on `to` (default: stdout), or nothing more when `show`
    printed it itself (returning None). 0, the exit code of a command that got its answer."""
    if as_json:
        print(json.dumps(data, indent=indent))
        return 0
    shown = show(data) if show is not None else None
    if shown is not None:
        (to or console).print(shown)
    return 0


def plan_table(plan: dict) -> Table:
    """Both estimates per device, line by line of their breakdown, and the totals."""
    from rich.table import Table
    from rich.text import Text

    table = Table("per device", "ddp", "fsdp", title=f"{plan['parameters']:,} parameters on {plan['device']}")
    for key in dict.fromkeys([*plan["ddp"]["breakdown"], *plan["fsdp"]["breakdown"]]):
        row = [plan[s]["breakdown"].get(key) for s in ("ddp", "fsdp")]
        table.add_row(key, *("" if v is None else format_bytes(v) for v in row))
    table.add_row(Text("total", style="bold"), *(Text(format_bytes(plan[s]["total_bytes"]), style="bold")
                                                  for s in ("ddp", "fsdp")))
    return table


def format_bytes(n: float) -> str:
    """In the largest binary unit that keeps it at 1 or more (a tiny model's 3.2 MiB, not 0.003 GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def job_table(job: dict) -> Table:
    from rich.table import Table
    from rich.text import Text

    progress = job["progress"]
    table = Table(show_header=False, title=f"job {job['id']}")
    status = f"{job['status']} ({job['reason']})" if job.get("reason") else job["status"]
    for key, value in (("name", job["name"]), ("status", status), ("priority", job["priority"]),
                       ("attempt", f"{job['attempt']} (max retries {job['max_retries']})"),
                       ("step", f"{progress['step']}/{progress['total_steps'] or '?'}"),
                       ("eta", f"{progress['eta_s']:.0f} s" if progress.get("eta_s") is not None else ""),
                       ("created", job["created_at"]), ("started", job["started_at"] or ""),
                       ("finished", job["finished_at"] or "")):
        table.add_row(key, str(value))
    if job.get("pending_reason"):  # queued: why no worker has taken it yet; starting: what its worker does
        table.add_row("waiting" if job.get("status") == "queued" else "starting", Text(job["pending_reason"]))
    return table


def format_duration(seconds: float | None) -> str:
    """A short span, as squeue and kubectl write it: 45s, 12m05s, 3h12m, 2d03h."""
    if seconds is None:
        return ""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def since(start: str | None, end: str | None, now: datetime) -> float | None:
    if start is None:
        return None
    return ((datetime.fromisoformat(end) if end else now) - datetime.fromisoformat(start)).total_seconds()


def shorten(text: str, width: int) -> str:
    """`text` in `width` characters: its start and its end kept (trial-007 and run-2 stay apart), … between."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    tail = (width - 1) // 3
    return text[:width - 1 - tail] + "…" + (text[-tail:] if tail else "")


MIN_NAME = 8
STATUS_LEN = 9  # the longest status without a reason: succeeded, cancelled
WIDE = 120  # from this many columns on, the jobs list also shows owner, strategy, world and why a job waits


def job_row(job: dict, now: datetime) -> dict[str, str]:
    progress, resources = job["progress"], job["spec"]["resources"]
    return {
        "ID": job["id"], "NAME": job["name"],
        "STATUS": f"{job['status']} ({job['reason']})" if job.get("reason") else job["status"],
        "STEP": f"{progress['step']}/{progress['total_steps'] or '?'}",
        # run time: started to finished (or now); a job that never started has none
        "ELAPSED": format_duration(since(job.get("started_at"), job.get("finished_at"), now)),
        "AGE": format_duration(since(job["created_at"], None, now)),
        "OWNER": job["owner"], "STRATEGY": job["spec"]["strategy"],
        "WORLD": f"{resources['nnodes']}×{resources['nproc_per_node']}",
        "WAITING": job.get("pending_reason") or "",
    }


def jobs_lines(jobs: list[dict], width: int = 80, now: datetime | None = None) -> list[str]:
    """The jobs list as plain columns that fit `width` (a terminal's columns; 80 when piped): every id and status
    whole, the name shortened to what is left. Plain text, not a rich table: a pipe, grep and awk read it too."""
    now = now or datetime.now(UTC)
    rows = [job_row(job, now) for job in jobs]
    columns = ["ID", "NAME", "STATUS", "STEP", "ELAPSED", "AGE"]
    if width >= WIDE:
        columns = ["ID", "NAME", "OWNER", "STATUS", "STRATEGY", "WORLD", "STEP", "ELAPSED", "AGE", "WAITING"]
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns}
    if "WAITING" in widths:  # the last column: whatever room is left, cut at the end
        fixed = sum(w + 2 for c, w in widths.items() if c != "WAITING")
        widths["WAITING"] = max(len("WAITING"), min(widths["WAITING"], width - fixed))
    room = width - sum(w + 2 for c, w in widths.items() if c != "NAME")
    # Too narrow for the names: the reasons give way first (`status ID` and a wide list show them).
    if room < min(MIN_NAME, widths["NAME"]) and widths["STATUS"] > STATUS_LEN:
        for r, job in zip(rows, jobs, strict=True):
            r["STATUS"] = job["status"]
        before, widths["STATUS"] = widths["STATUS"], max([len("STATUS")] + [len(r["STATUS"]) for r in rows])
        room += before - widths["STATUS"]
    widths["NAME"] = min(widths["NAME"], max(MIN_NAME, room))
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    for r in rows:
        cells = []
        for c in columns:
            text = shorten(r[c], widths[c]) if c in ("NAME", "WAITING") else r[c]
            cells.append(text.rjust(widths[c]) if c in ("STEP", "ELAPSED", "AGE") else text.ljust(widths[c]))
        lines.append("  ".join(cells).rstrip())
    return lines


def workers_table(page: dict, now: datetime | None = None) -> Table:
    """One row a worker: its state, what it offers (device, slots, memory, labels), what it runs, when it was
    last heard from. Its address and host are in --json."""
    from rich.table import Column, Table

    now = now or datetime.now(UTC)
    # The devices column only where a worker lists its devices (one of an earlier version does not).
    shows_devices = any(w.get("devices") for w in page["items"])
    table = Table(Column("state", no_wrap=True), Column("id", no_wrap=True), Column("busy slots", no_wrap=True),
                  *([Column("devices", no_wrap=True)] if shows_devices else []), "memory", "labels", "jobs",
                  Column("seen", no_wrap=True), title=f"{len(page['items'])} workers")
    for w in page["items"]:
        seen = max(0.0, (now - datetime.fromisoformat(w["last_seen"])).total_seconds())
        state = f"{w['state']}, disk pressure" if w.get("pressure") else w["state"]  # why: in --json
        jobs = w.get("jobs") or ([w["current_job"]] if w["current_job"] else [])
        table.add_row(state, w["id"], f"{w['busy_slots']}/{w['slots']} {w['device']}",
                      *([occupancy(w)] if shows_devices else []),
                      f"{w['memory_gb']:g} GiB" if w["memory_gb"] is not None else "",
                      " ".join(f"{k}={v}" for k, v in sorted(w["labels"].items())), " ".join(jobs),
                      f"{seen:.0f}s ago")
    return table


def occupancy(worker: dict) -> str:
    """Its devices at a glance, in index order: ■ held (by any job), □ free, ✗ unhealthy."""
    marks = {"held": "■", "free": "□", "unhealthy": "✗"}
    return "".join(marks.get(d["state"], "?") for d in worker.get("devices") or [])
