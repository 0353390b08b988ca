"""What a training rank pays to import the runtime: wall time, RSS, and whether SQLAlchemy comes along.

A rank runs `python -m worker.train RUN_DIR`; everything `worker.train.main` imports is paid by every rank
of every attempt before its first step. This measures a fresh interpreter importing it, `python -X
importtime` for the split (torch's own share vs the rest), ru_maxrss for memory.

    python bench/rank_imports.py                       # this tree
    python bench/rank_imports.py --baseline /tmp/old   # and an older checkout, alternating, as ratios
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import resource, sys, time\n"
    "t = time.perf_counter()\n"
    "import worker.train.main\n"
    "t = time.perf_counter() - t\n"
    "import json\n"
    "print(json.dumps({'s': t, 'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,\n"
    "  'sqlalchemy': 'sqlalchemy' in sys.modules, 'modules': len(sys.modules),\n"
    "  'service': sorted(m for m in sys.modules if m.split('.')[0] == 'service')[:5]}))\n"
)


def measure(tree: Path) -> dict:
    """One fresh interpreter in `tree`: the import's wall time and RSS, and -X importtime's split."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE], cwd=tree, env=env,
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    # importtime lines: "import time: self [us] | cumulative | imported package"; self times add up to the whole.
    by_root: dict[str, float] = {}
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0].split(":")[-1].strip().isdigit():
            root = parts[2].strip().split(".")[0]
            by_root[root] = by_root.get(root, 0.0) + int(parts[0].split(":")[-1]) / 1e6
    out["torch_s"] = by_root.get("torch", 0.0)
    out["not_torch_s"] = sum(by_root.values()) - out["torch_s"]
    out["control_plane_s"] = sum(by_root.get(k, 0.0) for k in ("sqlalchemy", "service", "psycopg", "redis", "rq"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="an older checkout to compare with, alternating")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(measure(trees[name]))
    keys = ("s", "rss_mb", "torch_s", "not_torch_s", "control_plane_s")
    for name, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        print(f"{name:8s} import {med['s']:.2f} s (torch {med['torch_s']:.2f} s, the rest {med['not_torch_s']:.2f} s, "
              f"of it the control plane's {med['control_plane_s']:.3f} s), RSS {med['rss_mb']:.0f} MB, "
              f"{rows[0]['modules']} modules, sqlalchemy loaded: {rows[0]['sqlalchemy']}, "
              f"service modules: {rows[0]['service'] or 'none'}")
    if args.baseline:
        pairs = list(zip(runs["this"], runs["baseline"], strict=True))

        def ratio(key: str) -> str:
            return f"{statistics.median(a[key] / b[key] for a, b in pairs):.3f}"

        print(f"this / baseline (median of paired rounds): import {ratio('s')}, not-torch {ratio('not_torch_s')}, "
              f"RSS {ratio('rss_mb')}")


if __name__ == "__main__":
    main()
