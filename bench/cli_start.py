"""How long a CLI command takes, start to exit, against a live API (issue 43): `--help`, `status ID`, `list`,
`logs ID`, the median of N runs each (default 5), and `python -X importtime`'s top entries of a `status`.

    .venv/bin/python -m bench.cli_start [--runs 5] [--before DIR]

A throwaway stack on SQLite (bench/common.py) with one job that has ended; each command runs as a user runs it
(`python -m service.cli`, the API's URL and token in the environment, .pyc files written as a shell would).
`--before DIR`: another checkout (`git archive <commit> | tar -x -C DIR`) timed against the same stack, its runs
alternated with this one's, so both columns see the same load. Wall time and CPU time (user + system) are both
given: on a shared machine the CPU time is the steadier, and near what a quiet machine's wall time would be.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import bench_stack
from tests.conftest import mlp_spec

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {"--help": ["--help"], "status ID": ["status", "{id}"], "list": ["list"], "logs ID": ["logs", "{id}"]}


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one run."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_of(times: list[tuple[float, float]]) -> str:
    return f"{statistics.median(t[0] for t in times):.3f} s wall, {statistics.median(t[1] for t in times):.3f} s CPU"


def top_imports(argv: list[str], env: dict, cwd: Path, n: int) -> list[tuple[int, str]]:
    """The n largest cumulative import times (µs) of the modules a command imports at the top level."""
    run = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env, cwd=cwd, capture_output=True,
                         text=True, check=True)
    rows = []
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|", 2)
            if cumulative.strip().isdigit() and not name.startswith("  "):
                rows.append((int(cumulative), name.strip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another checkout to time beside this one")
    parser.add_argument("--importtime", type=int, default=8, help="how many top entries to print")
    args = parser.parse_args()
    trees = {"before": args.before, "now": ROOT} if args.before else {"now": ROOT}
    with bench_stack(workers=0) as (stack, api):
        job_id = api.post("/v1/jobs", json=mlp_spec(name="cli-start")).json()["id"]
        api.post(f"/v1/jobs/{job_id}/cancel")  # ended: status shows its outcome too
        env = {**os.environ, "TRAINJOBS_API_URL": stack.api_url, "TRAINJOBS_TOKEN": stack.token or "",
               "COLUMNS": "120"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's shell: the first run writes the .pyc files
        commands = {"python -c pass (the floor)": [sys.executable, "-c", "pass"]} | {
            f"trainjobs {label}": [sys.executable, "-m", "service.cli", *(a.format(id=job_id) for a in argv)]
            for label, argv in COMMANDS.items()}
        print(f"median of {args.runs}; " + ", ".join(f"{name}: {tree}" for name, tree in trees.items()))
        for label, argv in commands.items():
            times: dict[str, list] = {name: [] for name in trees}
            for tree in trees.values():
                timed(argv, env, tree)  # warm: the page cache and the .pyc files
            for _ in range(args.runs):
                for name, tree in trees.items():
                    times[name].append(timed(argv, env, tree))
            print(f"{label}: " + " | ".join(f"{name} {median_of(t)}" for name, t in times.items()))
        for name, tree in trees.items():
            print(f"top imports of `trainjobs status ID`, {name} (cumulative ms, one run):")
            for us, module in top_imports(["-m", "service.cli", "status", job_id], env, tree, args.importtime):
                print(f"  {us / 1000:6.1f}  {module}")


if __name__ == "__main__":
    main()
