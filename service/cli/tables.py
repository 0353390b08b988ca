"""How the CLI shows a memory plan, a job, a page of jobs and the workers: rich tables (`--json` prints the API's
JSON)."""

from datetime import UTC, datetime

from rich.table import Column, Table
from rich.text import Text


def plan_table(plan: dict) -> Table:
    """Both estimates per device, line by line of their breakdown, and the totals."""
    table = Table("per device", "ddp", "fsdp", title=f"{plan['parameters']:,} parameters on {plan['device']}")
    for key in dict.fromkeys([*plan["ddp"]["breakdown"], *plan["fsdp"]["breakdown"]]):
        row = [plan[s]["breakdown"].get(key) for s in ("ddp", "fsdp")]
        table.add_row(key, *("" if v is None else f"{v / 2**30:.3f} GiB" for v in row))
    table.add_row(Text("total", style="bold"), *(Text(f"{plan[s]['total_gib']:.3f} GiB", style="bold")
                                                  for s in ("ddp", "fsdp")))
    return table


def job_table(job: dict) -> Table:
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
    if job.get("pending_reason"):  # queued: why no worker has taken it yet
        table.add_row("waiting", Text(job["pending_reason"]))
    return table


def jobs_table(page: dict) -> Table:
    """One row a job: who, how it runs (strategy, nnodes × processes per node) and how far it got."""
    table = Table(Column("id", no_wrap=True), "name", "owner", "status", "strategy", "world", "step",
                  Column("created (UTC)", no_wrap=True))
    for job in page["items"]:
        progress, resources = job["progress"], job["spec"]["resources"]
        status = f"{job['status']} ({job['reason']})" if job.get("reason") else job["status"]
        table.add_row(job["id"], job["name"], job["owner"], status, job["spec"]["strategy"],
                      f"{resources['nnodes']}×{resources['nproc_per_node']}",
                      f"{progress['step']}/{progress['total_steps'] or '?'}", job["created_at"][:16].replace("T", " "))
    return table


def workers_table(page: dict, now: datetime | None = None) -> Table:
    """One row a worker: its state, what it offers (device, slots, memory, labels), what it runs, when it was
    last heard from. Its address and host are in --json."""
    now = now or datetime.now(UTC)
    table = Table(Column("state", no_wrap=True), Column("id", no_wrap=True), Column("busy slots", no_wrap=True),
                  "memory", "labels", "job", Column("seen", no_wrap=True), title=f"{len(page['items'])} workers")
    for w in page["items"]:
        seen = max(0.0, (now - datetime.fromisoformat(w["last_seen"])).total_seconds())
        state = f"{w['state']}, disk pressure" if w.get("pressure") else w["state"]  # why: in --json
        table.add_row(state, w["id"], f"{w['busy_slots']}/{w['slots']} {w['device']}",
                      f"{w['memory_gb']:g} GiB" if w["memory_gb"] is not None else "",
                      " ".join(f"{k}={v}" for k, v in sorted(w["labels"].items())), w["current_job"] or "",
                      f"{seen:.0f}s ago")
    return table
