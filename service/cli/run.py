"""`trainjobs run [flags] -- train.py ARGS`: a job spec from flags, for the folder you are in.

    cd my-project/ && trainjobs run --nproc-per-node 2 --follow -- train.py --lr 3e-4

The folder (`--workdir`, default `.`) is packed and uploaded with the job (only if the API does not hold
that package already); the script is relative to it. `--dry-run` prints the spec and sends nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli import tables
from service.cli.console import LazyConsole
from service.cli.follow import add_output_flags, check_rank, submitted

if TYPE_CHECKING:  # annotations only: httpx loads when main() makes the Client, not for `trainjobs --help`
    from trainjobs.client import Client

console = LazyConsole(markup=False)
err = LazyConsole(stderr=True, markup=False)


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def make_spec(args) -> dict:
    """The spec the flags describe, validated here (a bad flag is an error before anything is packed)."""
    from trainjobs.spec import JobSpec, read_requirements  # pydantic's models: only for `run`, not every command

    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.module:
        target, name = {"module": args.module, "args": list(args.command)}, args.module.rsplit(".", 1)[-1]
    else:
        if not args.command:
            raise ValueError("name the script to run: trainjobs run [flags] -- train.py [args] (or --module M)")
        script, *script_args = args.command
        target, name = {"script": script, "args": script_args}, Path(script).stem
    spec = {
        "name": args.name or name,
        "strategy": args.strategy,
        "resources": {"nnodes": args.nnodes, "nproc_per_node": args.nproc_per_node, "device": args.device},
        "entrypoint": target,
        "priority": args.priority,
        "max_retries": args.max_retries,
        "env": dict(args.env or []),
    }
    if args.timeout is not None:
        spec["timeout_s"] = args.timeout
    if args.tag:
        spec["tags"] = list(args.tag)
    if args.requirements:
        path = Path(args.requirements)
        if not path.is_file():
            raise ValueError(f"--requirements {path} is not a file")
        if lines := read_requirements(path.read_text()):
            spec["entrypoint"]["requirements"] = lines
    JobSpec.model_validate(spec)  # the API would refuse it: say so now, naming the field
    return spec


def cmd_run(args, client: Client) -> int:
    spec = make_spec(args)
    if args.follow:  # before anything is packed or sent
        check_rank(args.rank, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, job="the job")
    workdir = None if args.no_workdir else Path(args.workdir)
    if workdir is not None:
        if not workdir.is_dir():
            raise ValueError(f"--workdir {workdir} is not a folder")
        script = spec["entrypoint"].get("script")
        if script is not None and not (workdir / script).is_file():
            raise ValueError(f"{script} is not a file in the working directory {workdir.resolve()}")
    if args.dry_run:
        if workdir is not None:
            from trainjobs.packing import pack

            with pack(workdir) as packed:  # what would be uploaded: its digest, nothing sent
                spec["entrypoint"]["package"] = packed.digest
                err.print(f"{workdir.resolve()}: {packed.files} member(s), {packed.size} bytes packed")
        return tables.answer(spec, True)  # the spec, whatever --json says: that is what a dry run shows
    if workdir is not None:
        client.validate(spec, allow_unschedulable=args.allow_unschedulable)  # a spec refused costs no upload
        spec["entrypoint"]["package"] = upload(client, workdir)
    return submitted(client, client.submit(spec, allow_unschedulable=args.allow_unschedulable), args, console)


def upload(client: Client, workdir: Path) -> str:
    """Pack and upload the folder (if the API does not hold it yet), saying which on stderr."""
    digest = client.upload_package(workdir)
    sent = client.last_upload
    err.print(f"uploaded {workdir.resolve()} as {digest} ({sent.size} bytes, {sent.files} members)" if sent
              else f"{workdir.resolve()} is {digest}, which the service has already: nothing uploaded")
    return digest


def cmd_packages(args, client: Client) -> int:
    if args.rm:
        client.delete_package(args.rm)
        err.print(f"deleted {args.rm}")
        return 0
    def show(page: dict) -> str:
        for p in page["items"]:
            console.print(f"{p['digest']}  {p['size']:>12} bytes  {p['files']:>6} members  {p['created_at']}")
        return f"{page['count']} package(s), {page['bytes']} bytes"

    return tables.answer(client.packages(), args.json, show, to=console)


def register(sub) -> None:
    run = sub.add_parser("run", help="run a script of this folder on the pool (packs and uploads the folder)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS]",
                     help="the script (relative to the working directory) and its arguments")
    run.add_argument("--module", "-m", help="run python -m MODULE instead of a script (the command is its args)")
    run.add_argument("--workdir", default=".", help="the folder to ship with the job (default: .)")
    run.add_argument("--no-workdir", action="store_true",
                     help="ship nothing: the script is one the workers have (TRAINJOBS_SCRIPTS_DIR)")
    run.add_argument("--nproc-per-node", type=int, default=1, metavar="N")
    run.add_argument("--nnodes", type=int, default=1, metavar="N")
    run.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    run.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    run.add_argument("--name", help="default: the script's (or module's) name")
    run.add_argument("--priority", choices=["high", "normal", "low"], default="normal")
    run.add_argument("--env", action="append", type=env_pair, metavar="NAME=VALUE", help="for every rank; repeat")
    run.add_argument("--tag", action="append", help="a free label, e.g. team=vision; repeat")
    run.add_argument("--requirements", metavar="FILE", help="a requirements file: the worker installs it into a "
                     "virtualenv on top of its own (cached per machine); its lines go into the spec")
    run.add_argument("--max-retries", type=int, default=0)
    run.add_argument("--timeout", type=float, metavar="SECONDS", help="timeout_s (default 3600)")
    run.add_argument("--dry-run", action="store_true", help="print the spec (and the package's digest); send nothing")
    run.add_argument("--follow", action="store_true",
                     help="stream the job's output (rank 0's; see --rank) and progress until it ends; exit 0 "
                     "succeeded, 1 failed, 130 cancelled (Ctrl-C stops following, not the job)")
    run.add_argument("--json", action="store_true", help="the job as JSON (with --follow: once it has ended)")
    add_output_flags(run)
    run.add_argument("--allow-unschedulable", action="store_true",
                        help="take the job though no live worker could run it now: it waits for one")
    run.set_defaults(remote=cmd_run)
    packages = sub.add_parser("packages", help="your uploaded working directories (list, or --rm DIGEST)")
    packages.add_argument("--rm", metavar="DIGEST", help="delete that package (sha256:...)")
    packages.add_argument("--json", action="store_true", help="the list as the API returns it")
    packages.set_defaults(remote=cmd_packages)
