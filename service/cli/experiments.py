"""Working with runs you already have: `trainjobs resubmit ID --set k=v`, `trainjobs metrics ID`, `trainjobs
artifacts ID [--download NAME]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from service.cli.follow import exit_code, follow, print_outcome

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from trainjobs.client import Client

console = Console(markup=False)
err = Console(stderr=True, markup=False)


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
    if args.json and not args.follow:
        print(json.dumps(job, indent=2))
        return 0
    if args.json:
        job = follow(client, job["id"])
        print(json.dumps(job, indent=2))
        return exit_code(job)
    console.print(f"submitted {job['id']} ({job['name']}), cloned from {job['cloned_from']}")
    return print_outcome(follow(client, job["id"], console), console) if args.follow else 0


def cmd_metrics(args, client: Client) -> int:
    if args.csv:
        for line in client.metrics_csv(args.job_id, name=args.name):
            sys.stdout.write(line + "\n")
        return 0
    answer = client.metrics(args.job_id, name=args.name)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    width = max([len("metric")] + [len(s["name"]) for s in answer["series"]])
    console.print(f"{'metric':<{width}}  {'points':>7}  {'steps':>15}  {'last':>11}  {'min':>11}  {'max':>11}")
    for s in answer["series"]:  # plain columns: readable in a terminal, and through a pipe
        values, steps = s["values"], s["steps"]
        console.print(f"{s['name']:<{width}}  {len(values):>7}  {f'{steps[0]}-{steps[-1]}':>15}  {values[-1]:>11.6g}  "
                      f"{min(values):>11.6g}  {max(values):>11.6g}")
    return 0


def cmd_artifacts(args, client: Client) -> int:
    if args.download:
        path = client.download(args.job_id, args.download, args.to)
        err.print(f"saved {path}")
        return 0
    files = client.artifacts(args.job_id)
    if args.json:
        print(json.dumps(files, indent=2))
        return 0
    for f in files:
        console.print(f"{f['size']:>12}  {f['modified']}  {f['name']}")
    return 0


def register(sub) -> None:
    resubmit = sub.add_parser("resubmit", help="a new job from another's spec, changed: --set optimizer.lr=3e-4")
    resubmit.add_argument("job_id")
    resubmit.add_argument("--set", action="append", type=override, metavar="PATH=VALUE",
                          help="a spec field by its dotted path (the value read as YAML); repeat")
    resubmit.add_argument("--follow", action="store_true", help="stream progress until the job ends")
    resubmit.add_argument("--json", action="store_true", help="the new job as JSON")
    resubmit.set_defaults(remote=cmd_resubmit)
    metrics = sub.add_parser("metrics", help="a job's metric series: a summary table, --csv every point, or --json")
    metrics.add_argument("job_id")
    metrics.add_argument("--name", help="one series (e.g. loss)")
    metrics.add_argument("--csv", action="store_true", help="step,name,value,node_rank,attempt,time: every point")
    metrics.add_argument("--json", action="store_true", help="the series as the API returns them")
    metrics.set_defaults(remote=cmd_metrics)
    artifacts = sub.add_parser("artifacts", help="a job's output files, or --download NAME")
    artifacts.add_argument("job_id")
    artifacts.add_argument("--download", metavar="NAME", help="save that file (streamed; no partial file is left)")
    artifacts.add_argument("--to", type=Path, metavar="DIR_OR_FILE", help="where to save it (default: .)")
    artifacts.add_argument("--json", action="store_true", help="the list as the API returns it")
    artifacts.set_defaults(remote=cmd_artifacts)
