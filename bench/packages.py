"""Submit → first training step of the same script: pre-placed in the scripts folder vs shipped as a package.

For each size (1 MB and 50 MB of incompressible files beside the script): the first submission packs,
uploads and the worker unpacks; the second finds the package on the API (HEAD) and in the worker's cache.
The script prints the wall-clock time of its first step; the bench subtracts the moment it started packing
(or submitting, for the pre-placed script). Rounds alternate the pre-placed and the cached runs; the cached
package's cost over a pre-placed script is the median of their differences (goal: at most +0.2 s).
"""

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_stack, wait_job  # noqa: E402
from trainjobs import Client  # noqa: E402

SCRIPT = """\
import sys, time
import torch
x = torch.ones(4, 4) @ torch.ones(4, 4)  # the first training step, as far as this bench cares
print(f"first step at {time.time():.6f}", flush=True)
"""
FIRST = re.compile(r"first step at ([\d.]+)")


def make_folder(root: Path, megabytes: int) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text(SCRIPT)
    (root / "blob.bin").write_bytes(os.urandom(megabytes * 2**20))  # random: the gzip cannot shrink it
    return root


def first_step(client: Client, spec: dict, started: float) -> float:
    job = client.submit(spec)
    job = wait_job(client.http, job["id"], poll_s=0.2)
    assert job["status"] == "succeeded", job["error"]
    return float(FIRST.search(client.logs(job["id"]))[1]) - started


def preplaced(client: Client) -> float:
    started = time.time()
    return first_step(client, {"name": "pre", "entrypoint": {"script": "train.py"}}, started)


def shipped(client: Client, folder: Path) -> tuple[float, float]:
    """(submit → first step, of which pack + upload) for the folder as a package."""
    started = time.time()
    digest = client.upload_package(folder)
    uploaded = time.time() - started
    return first_step(client, {"name": "pkg", "entrypoint": {"package": digest, "script": "train.py"}}, started), \
        uploaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-packages-") as tmp:
        scripts = Path(tmp) / "scripts"
        scripts.mkdir()
        (scripts / "train.py").write_text(SCRIPT)
        with bench_stack(allow_entrypoints=True, scripts_dir=scripts) as (stack, _api), \
                Client(stack.api_url, token=stack.token) as client:
            preplaced(client)  # warm: the worker's first torch import
            for megabytes in (1, 50):
                firsts, uploads, cached, pre = [], [], [], []
                for i in range(args.rounds):
                    folder = make_folder(Path(tmp) / f"p{megabytes}-{i}", megabytes)
                    first, upload = shipped(client, folder)
                    firsts.append(first)
                    uploads.append(upload)
                    if i % 2 == 0:
                        pre.append(preplaced(client))
                        cached.append(shipped(client, folder)[0])
                    else:
                        cached.append(shipped(client, folder)[0])
                        pre.append(preplaced(client))
                    shutil.rmtree(folder)
                extra = [c - p for c, p in zip(cached, pre, strict=True)]
                print(f"{megabytes} MB package: submit → first step, first {statistics.median(firsts):.2f}s "
                      f"(pack + upload {statistics.median(uploads):.2f}s), cached {statistics.median(cached):.2f}s, "
                      f"pre-placed script {statistics.median(pre):.2f}s; cached − pre-placed median "
                      f"{statistics.median(extra):+.3f}s (min {min(extra):+.3f}, max {max(extra):+.3f}) over "
                      f"{args.rounds} rounds; goal <= +0.2s")
                first_cost = statistics.median(f - c for f, c in zip(firsts, cached, strict=True))
                rate = f"{megabytes / first_cost:.0f} MB/s" if first_cost > 0.05 else "within the noise"
                print(f"{megabytes} MB package: the first submission costs {first_cost:+.2f}s over a cached one: "
                      f"{rate} for pack + upload + unpack")


if __name__ == "__main__":
    main()
