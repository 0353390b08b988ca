"""Working with runs you already have: `trainjobs resubmit ID --set k=v`, `trainjobs metrics ID`, `trainjobs
artifacts ID [--download NAME]`, `trainjobs download ID [NAME ...] --to DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole
from service.cli.follow import submitted

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from trainjobs.client import Client

console = LazyConsole(markup=False)
JOB_HELP = "a job id, a unique prefix of it (4 characters or more) or the job's exact name"
err = LazyConsole(stderr=True, markup=False)


def override(text: str) -> tuple[str, object]:
    """PATH=VALUE, the value read as YAML (3e-4 a number, true a bool, [1, 2] a list, anything else a string)."""
    import yaml  # here, not at the top: only `resubmit --set` needs it, and every command imports this module

    path, sep, value = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not PATH=VALUE (e.g. optimizer.lr=3e-4)")
    try:
        return path, yaml.safe_load(value) if value else ""
    except yaml.YAMLError:
        return path, value


def cmd_resubmit(args, client: Client) -> int:
    job = client.clone(args.job_id, dict(args.set or []))
    return submitted(client, job, args, console, note=f", cloned from {job['cloned_from']}")


def check_metric_name(client: Client, job_id: str, name: str, answer: dict | None = None) -> None:
    """A name the job has no series of is an error that lists the names it has (and the closest). `answer`: the
    API's answer for that name, when read already."""
    if (answer or client.metrics(job_id, name=name, max_points=1))["series"]:
        return
    import difflib

    names = sorted(s["name"] for s in client.metrics(job_id, max_points=1)["series"])
    if not names:
        raise ValueError(f"job {job_id} has no metrics yet, so none named {name!r}")
    close = difflib.get_close_matches(name, names, n=1)
    raise ValueError(f"job {job_id} has no metric {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                     + f" Its metrics: {', '.join(names)}")


def cmd_metrics(args, client: Client) -> int:
    """Without --name: one line per series (its last step and value, min and max); --name: that one."""
    if args.csv:
        if args.name:
            check_metric_name(client, args.job_id, args.name)
        for line in client.metrics_csv(args.job_id, name=args.name):
            sys.stdout.write(line + "\n")
        return 0
    answer = client.metrics(args.job_id, name=args.name)
    if args.name:
        check_metric_name(client, args.job_id, args.name, answer)
    return tables.answer(answer, args.json, lambda answer: print_series(args.job_id, answer))


def print_series(job_id: str, answer: dict) -> None:
    """A line a series: plain columns, readable in a terminal and through a pipe."""
    series = [s for s in answer["series"] if s["values"]]
    if not series:
        console.print(f"job {job_id} has no metrics yet")
        return
    width = max([len("metric")] + [len(s["name"]) for s in series])
    console.print(f"{'metric':<{width}}  {'last step':>9}  {'last':>11}  {'min':>11}  {'max':>11}  {'points':>7}")
    for s in series:
        values, steps = s["values"], s["steps"]
        console.print(f"{s['name']:<{width}}  {steps[-1]:>9}  {values[-1]:>11.6g}  {min(values):>11.6g}  "
                      f"{max(values):>11.6g}  {len(values):>7}")


def cmd_artifacts(args, client: Client) -> int:
    if args.download:
        path = client.download(args.job_id, args.download, args.to)
        err.print(f"saved {path}", soft_wrap=True)
        return 0
    def show(files: list[dict]) -> None:
        if not files:
            console.print(f"job {args.job_id} has no artifacts (yet)")
        for f in files:
            console.print(f"{f['size']:>12}  {f['modified']}  {f['name']}")

    return tables.answer(client.artifacts(args.job_id), args.json, show)


def cmd_download(args, client: Client) -> int:
    """The artifacts named (default: every one) into the folder --to (made if missing), their paths kept."""
    listed = {f["name"]: f for f in client.artifacts(args.job_id)}
    names = args.names or sorted(listed)
    if not names:
        raise ValueError(f"job {args.job_id} has no artifacts (yet): nothing to download")
    missing = [n for n in names if n not in listed]
    if missing:
        raise ValueError(f"job {args.job_id} has no artifact {', '.join(map(repr, missing))}; it has: "
                         f"{', '.join(sorted(listed)) or 'none'}")
    folder = Path(args.to)
    for name in names:
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts:  # the API never lists one; never written outside
            raise ValueError(f"artifact name {name!r} points outside the folder")
        path = client.download(args.job_id, name, folder / relative)
        err.print(f"saved {path} ({listed[name]['size']} bytes)", soft_wrap=True)
    return 0


def register(sub) -> None:
    resubmit = sub.add_parser("resubmit", help="a new job from another's spec, changed: --set optimizer.lr=3e-4")
    resubmit.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    resubmit.add_argument("--set", action="append", type=override, metavar="PATH=VALUE",
                          help="a spec field by its dotted path (the value read as YAML); repeat")
    resubmit.add_argument("--follow", action="store_true", help="stream progress until the job ends")
    resubmit.add_argument("--json", action="store_true", help="the new job as JSON")
    resubmit.set_defaults(remote=cmd_resubmit)
    metrics = sub.add_parser("metrics", help="a job's metric series: a line each (last step and value), --csv "
                             "every point, or --json")
    metrics.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    metrics.add_argument("--name", help="one series (e.g. loss); a name the job lacks lists those it has")
    metrics.add_argument("--csv", action="store_true", help="step,name,value,node_rank,attempt,time: every point")
    metrics.add_argument("--json", action="store_true", help="the series as the API returns them")
    metrics.set_defaults(remote=cmd_metrics)
    artifacts = sub.add_parser("artifacts", help="a job's output files, or --download NAME")
    artifacts.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    artifacts.add_argument("--download", metavar="NAME", help="save that file (streamed; no partial file is left)")
    artifacts.add_argument("--to", type=Path, metavar="DIR_OR_FILE", help="where to save it (default: .)")
    artifacts.add_argument("--json", action="store_true", help="the list as the API returns it")
    artifacts.set_defaults(remote=cmd_artifacts)
    download = sub.add_parser("download", help="save a job's artifacts (all, or those named) into a folder")
    download.add_argument("job_id", metavar="JOB", help=JOB_HELP)
    download.add_argument("names", nargs="*", metavar="NAME", help="an artifact (`trainjobs artifacts JOB` lists "
                          "them); default: every one")
    download.add_argument("--to", default=".", metavar="DIR", help="the folder to save into, made if missing "
                          "(default: .); an artifact's subfolders are kept")
    download.set_defaults(remote=cmd_download)
