"""`trainjobs list` (a page or --all, in 80 columns) and `trainjobs cancel ID [ID ...]` or a filter."""

from __future__ import annotations

import shutil
import sys
from itertools import islice
from typing import TYPE_CHECKING

from service.cli import ids, tables
from service.cli.console import LazyConsole
from trainjobs.states import TERMINAL, JobStatus

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from trainjobs.client import Client

console = LazyConsole(markup=False, highlight=False, soft_wrap=True)
err = LazyConsole(stderr=True, markup=False, highlight=False, soft_wrap=True)
PAGE = 500  # the API's largest page


def positive(text: str) -> int:
    import argparse

    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def terminal_width() -> int:
    """COLUMNS, else the terminal's width, else 80 (a pipe)."""
    return shutil.get_terminal_size((80, 24)).columns


def owner_filter(args, client: Client) -> str | None:
    return client.me()["user"] if getattr(args, "mine", False) else None


def cmd_list(args, client: Client) -> int:
    owner = owner_filter(args, client)
    if args.sweep:  # a prefix or a name, as for the sweep commands
        args.sweep = ids.resolve_sweep(client, args.sweep)
    wanted = None if args.all else args.limit
    found = client.iter_jobs(args.status, name=args.name, tag=args.tag, sweep=args.sweep, owner=owner,
                             page_size=PAGE if wanted is None else min(wanted + 1, PAGE))
    jobs = list(found if wanted is None else islice(found, wanted + 1))  # one more than shown: are there more?
    more = wanted is not None and len(jobs) > wanted
    jobs = jobs[:wanted]
    if args.json:  # the API's page shape: next_cursor resumes after the last job shown
        return tables.answer({"items": jobs, "next_cursor": jobs[-1]["id"] if more else None}, True)
    if not jobs:
        console.print("no jobs" + (" match" if any((args.status, args.name, args.tag, args.sweep, owner)) else
                                   " yet: `trainjobs submit SPEC` or `trainjobs run -- train.py` makes one"))
        return 0
    for line in tables.jobs_lines(jobs, terminal_width()):
        console.print(line, overflow="ignore", crop=False, soft_wrap=True)
    if more:
        err.print(f"the newest {len(jobs)} shown; more exist: --limit N, or --all for every one")
    return 0


def selected(args, client: Client) -> list[dict]:
    """The jobs a filter names, not yet ended, newest first."""
    status = "queued" if args.all_queued else args.status
    owner = owner_filter(args, client)
    return [job for job in client.iter_jobs(status, name=args.name, owner=owner, page_size=PAGE)
            if job["status"] not in TERMINAL]


def confirm(jobs: list[dict], args) -> bool:
    """Ask before cancelling what a filter named (never when stdin is not a terminal: --yes says it there)."""
    for line in tables.jobs_lines(jobs, terminal_width()):
        err.print(line, overflow="ignore", crop=False, soft_wrap=True)
    if not sys.stdin.isatty():
        err.print(f"not cancelling these {len(jobs)} job(s) without --yes (stdin is not a terminal to ask on)")
        return False
    answer = input(f"cancel these {len(jobs)} job(s)? [y/N] ").strip().lower()
    return answer in ("y", "yes")


def cancel_one(client: Client, job_id: str, label: str) -> tuple[dict | None, str, bool]:
    """(the job, the line that says what happened, whether it went as asked)."""
    from trainjobs.client import APIError

    try:
        job = client.cancel(job_id)
    except APIError as exc:
        if exc.status == 409:
            return None, f"{label}: not cancelled: {exc.detail}", False
        if exc.status == 404:
            return None, f"{label}: no such job", False
        raise
    if job["status"] == "cancelled":
        return job, f"{label}: cancelled", True
    return job, f"{label}: cancel requested ({job['status']}: its processes are being stopped)", True


def cmd_cancel(args, client: Client) -> int:
    """Each job named, or each that the filter finds, cancelled; a line for each. Exit 0 when all went as asked,
    1 when one could not be (not found, ambiguous, already ended), 2 when nothing was tried."""
    if not args.job_ids and not (args.all_queued or args.status or args.name):
        raise ValueError("name the jobs to cancel (ids, unique prefixes or names), or a filter: --all-queued, "
                         "--status S, --name PREFIX")
    if args.job_ids and (args.all_queued or args.status or args.name):
        raise ValueError("give jobs or a filter, not both")
    targets: list[tuple[str, str | None, str]] = []  # (label, job id or None, why none)
    if args.job_ids:
        for ref in args.job_ids:
            try:
                targets.append((ref, ids.resolve(client, ref), ""))
            except ValueError as exc:
                targets.append((ref, None, str(exc)))
    else:
        jobs = selected(args, client)
        if not jobs:
            console.print("no job matches: nothing cancelled")
            return 0
        if not args.yes and not confirm(jobs, args):
            return 2
        targets = [(f"{job['id']} ({job['name']})", job["id"], "") for job in jobs]
    ok, done = True, []
    for label, job_id, why in targets:
        if job_id is None:
            console.print(f"{label}: {why}")
            ok = False
            continue
        job, line, went = cancel_one(client, job_id, label if label.startswith(job_id) else f"{label} ({job_id})")
        ok &= went
        if args.json:
            if job is not None:
                done.append(job)
            err.print(line)
        else:
            console.print(line)
    if args.json:
        tables.answer(done[0] if len(args.job_ids or []) == 1 and done else done, True)
    return 0 if ok else 1


def register(sub) -> None:
    ls = sub.add_parser("list", help="recent jobs, newest first (--all: every one)")
    ls.add_argument("--status", choices=[s.value for s in JobStatus])
    ls.add_argument("--limit", type=positive, default=20, metavar="N", help="the newest N (default 20)")
    ls.add_argument("--all", action="store_true", help="every job that matches, page after page")
    ls.add_argument("--name", help="jobs whose name starts with it")
    ls.add_argument("--tag", help="jobs that carry this tag (spec.tags)")
    ls.add_argument("--sweep", metavar="SWEEP", help="the trials of this sweep (its id, a unique prefix "
                    "or its exact name)")
    ls.add_argument("--mine", action="store_true", help="only your own jobs (an admin sees everyone's)")
    ls.add_argument("--json", action="store_true", help="the jobs as the API returns them: {items, next_cursor}")
    ls.set_defaults(remote=cmd_list)
    cancel = sub.add_parser("cancel", help="cancel jobs: ids (or unique prefixes, or names), or a filter",
                            description="Cancel each job named, or every job a filter finds (asking first "
                            "unless --yes). A queued job is cancelled at once; a running one once its "
                            "processes are stopped.")
    cancel.add_argument("job_ids", nargs="*", metavar="JOB", help="a job id, a unique prefix of it, or its name")
    cancel.add_argument("--all-queued", action="store_true", help="every queued job (yours; an admin's: all)")
    cancel.add_argument("--status", choices=["queued", "starting", "running"], help="every job in this state")
    cancel.add_argument("--name", metavar="PREFIX", help="every job not yet ended whose name starts with it")
    cancel.add_argument("--mine", action="store_true", help="with a filter: only your own jobs")
    cancel.add_argument("--yes", "-y", action="store_true", help="do not ask before cancelling what a filter found")
    cancel.add_argument("--json", action="store_true",
                        help="the cancelled jobs as JSON (one ID: the job), the lines on stderr")
    cancel.set_defaults(remote=cmd_cancel)
