"""`trainjobs gc`: finished jobs' logs, metric points, events, folders and stored objects deleted past an age
(jobs/retention.py)."""

from datetime import timedelta
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole
from service.cli.tokens import parse_duration

if TYPE_CHECKING:  # annotations only: main() hands this command the settings it has loaded
    from service.settings import Settings

console = LazyConsole()
DEFAULT_DAYS = 30


def cmd_gc(args, settings: "Settings") -> int:
    # NOTE: the database, here only: the CLI's client commands import this module too, and must not load SQLAlchemy.
    from service.db import make_engine, make_sessionmaker, utcnow
    from service.jobs import retention
    from service.storage import check_store

    older_than = timedelta(seconds=args.older_than) if args.older_than else timedelta(
        days=settings.retention_days or DEFAULT_DAYS)
    store = check_store(settings, who="gc")  # a store that does not answer stops it here, naming it
    engine = make_engine(settings.resolved_database_url)
    try:
        with make_sessionmaker(engine)() as db:
            done = retention.collect(db, cutoff=utcnow() - older_than, storage_dir=settings.resolved_storage_dir,
                                     store=store, dry_run=args.dry_run)
    finally:
        engine.dispose()
    verb = "would delete" if args.dry_run else "deleted"
    return tables.answer({"dry_run": args.dry_run, "older_than_s": older_than.total_seconds(), **done.as_dict()},
                         args.json, lambda _: f"jobs finished over {older_than} ago: {verb} {done.log_chunks} log "
                         f"chunks, {done.metric_points} metric points, {done.events} events, {done.folders} "
                         f"folders and {done.store_objects} objects in the store of {done.jobs} jobs (their rows and "
                         "metric summaries stay)", to=console,
                         indent=None)


def register(sub) -> None:
    gc = sub.add_parser("gc", help="delete finished jobs' logs, metric points, events, folders and stored "
                        "objects past an age")
    gc.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                    help=f"e.g. 30d (default: TRAINJOBS_RETENTION_DAYS, else {DEFAULT_DAYS}d)")
    gc.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    gc.set_defaults(local=cmd_gc)
