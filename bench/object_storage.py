"""Checkpoint upload throughput: the worker's upload (worker/store_sync.py) against a direct boto3 upload of the
same files, in one run, on one S3 server.

The checkpoint is a folder as the built-in runtime writes it (DCP shards, trainer.json, one RNG file per rank,
COMPLETE); "ours" is AttemptSync.upload_newest (every file opened with O_NOFOLLOW, then the manifest and
retention), "direct" is boto3's `upload_file` of each file, with its default transfer settings and with ours
(service/storage/s3.py TRANSFER: what our own overhead costs). Runs alternate, each into a fresh job prefix; the
ratios are of medians (throughput ours / direct, 1.0 = as fast).

`--step-time`: what uploading in the background costs training. A training process (torch, one thread: a
4-layer MLP, a checkpoint of about --ckpt-mb every --every steps on local disk, pruned to the last 2) runs with
the worker's upload thread (AttemptSync.start, in this process, as the supervisor runs it) and without, the two
alternated; the ratio is the mean step time without over with (1.0 = no cost), the median of the pairs.

    python bench/object_storage.py                          # moto's server on loopback, started here
    python bench/object_storage.py --step-time              # the step-time ratio
    AWS_ENDPOINT_URL=http://minio:9000 ... python bench/object_storage.py --bucket b   # a real server
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.settings import Settings  # noqa: E402
from service.storage import open_store  # noqa: E402
from service.storage.s3 import TRANSFER  # noqa: E402
from trainjobs.paths import new_job_id  # noqa: E402
from worker.store_sync import AttemptSync  # noqa: E402


def make_checkpoint(job_dir: Path, *, shards: int, shard_mb: int) -> tuple[Path, int]:
    folder = job_dir / "checkpoints" / "step_00000100"
    folder.mkdir(parents=True)
    for i in range(shards):
        (folder / f"__{i}_0.distcp").write_bytes(os.urandom(shard_mb * 2**20))
    for rank in range(shards):
        (folder / f"rng_rank{rank}.pt").write_bytes(os.urandom(6000))
    (folder / ".metadata").write_bytes(os.urandom(50_000))
    (folder / "trainer.json").write_text('{"step": 100}')
    (folder / "COMPLETE").write_text('{"step": 100}')
    return folder, sum(p.stat().st_size for p in folder.iterdir())


STORE_ELSEWHERE = "--store-elsewhere" in sys.argv


def start_moto() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --store-elsewhere: the server's CPU is not the training host's (as S3's or a MinIO host's is not): it runs at
    # SCHED_IDLE, so only the worker's own upload work competes with training.
    idle = ["chrt", "--idle", "0"] if STORE_ELSEWHERE else []
    server = subprocess.Popen([*idle, str(Path(sys.executable).with_name("moto_server")), "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    import boto3

    deadline = time.monotonic() + 30
    while True:
        try:
            boto3.client("s3").list_buckets()
            return server, os.environ["AWS_ENDPOINT_URL"]
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


TRAIN = """
import json, os, shutil, sys, time
import torch
torch.set_num_threads(1)
job_dir, steps, every, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, pad = torch.randn(64, 512), torch.randn(mb * 2**18)  # float32: mb MiB more in each checkpoint
root, kept = os.path.join(job_dir, "checkpoints"), []
start = time.perf_counter()
for step in range(1, steps + 1):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % every == 0:
        folder = os.path.join(root, f"step_{step:08d}")
        os.makedirs(folder)
        torch.save({"model": model.state_dict(), "pad": pad}, os.path.join(folder, "__0_0.distcp"))
        open(os.path.join(folder, "COMPLETE"), "w").write("{}")
        kept.append(folder)
        while len(kept) > 2:
            shutil.rmtree(kept.pop(0))
print(json.dumps((time.perf_counter() - start) / steps))
"""


def step_time(store, args) -> None:
    """Mean step time of the training process with the upload thread and without, alternated."""
    store.check()
    with_sync, without, stored = [], [], []
    for run in range(args.runs):
        for uploads in ((True, False) if run % 2 == 0 else (False, True)):
            with tempfile.TemporaryDirectory() as tmp:
                job_dir = Path(tmp) / "job"
                (job_dir / "checkpoints").mkdir(parents=True)
                sync = AttemptSync(store, job_id=new_job_id(), job_dir=job_dir, keep=2, wait_s=0)
                if uploads:
                    sync.start()
                out = subprocess.run([sys.executable, "-c", TRAIN, str(job_dir), str(args.steps), str(args.every),
                                      str(args.ckpt_mb)], capture_output=True, text=True, check=True)
                sync.close()
                (with_sync if uploads else without).append(float(out.stdout))
                if uploads:
                    stored.append(len(sync._manifests()))
    pairs = [w / u for w, u in zip(without, with_sync, strict=True)]
    print(f"store: {store.url}; {args.runs} pairs of {args.steps} steps, a {args.ckpt_mb} MiB checkpoint every "
          f"{args.every} steps; checkpoints stored per run with uploads: {stored}")
    print(f"mean step without uploads: {statistics.median(without) * 1e3:.2f} ms; with: "
          f"{statistics.median(with_sync) * 1e3:.2f} ms (medians of the runs)")
    print(f"step-time ratio without/with uploads: {statistics.median(pairs):.3f} (median of pairs; "
          f"min {min(pairs):.3f}, max {max(pairs):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", default=None, help="an existing bucket (default: moto's, started here)")
    parser.add_argument("--store-url", default=None, help="--step-time against this store instead (file:///dir: "
                        "the worker's own cost, without an S3 server on the same cores)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=32)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--step-time", action="store_true", help="the step-time ratio with uploads against none")
    parser.add_argument("--store-elsewhere", action="store_true", help="run moto at SCHED_IDLE, as a store on "
                        "another host: only the worker's own upload work then shares the training host's cores")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--ckpt-mb", type=int, default=32)
    args = parser.parse_args()
    if args.step_time and args.store_url:
        return step_time(open_store(Settings(storage_url=args.store_url)), args)
    server = None
    if args.bucket is None:
        server, endpoint = start_moto()
        args.bucket = "bench"
    import boto3

    try:
        client = boto3.client("s3")
        if server is not None:
            client.create_bucket(Bucket=args.bucket)
        store = open_store(Settings(storage_url=f"s3://{args.bucket}/bench"))
        if args.step_time:
            return step_time(store, args)
        with tempfile.TemporaryDirectory() as tmp:
            job_dir = Path(tmp) / "job"
            folder, size = make_checkpoint(job_dir, shards=args.shards, shard_mb=args.shard_mb)
            files = sorted(p for p in folder.iterdir())
            ours, direct, same = [], [], []
            for run in range(args.runs):
                job = new_job_id()

                def upload_ours(job=job) -> None:
                    sync = AttemptSync(store, job_id=job, job_dir=job_dir, keep=2, wait_s=0)
                    assert sync.upload_newest() == folder.name

                def upload_direct(job=job, **config) -> None:
                    for path in files:
                        client.upload_file(str(path), args.bucket, f"direct/{job}/{path.name}", **config)

                def upload_same(job=job) -> None:
                    upload_direct(job=f"{job}-same", Config=TRANSFER)

                ways = [(upload_ours, ours), (upload_direct, direct), (upload_same, same)]
                for upload, times in ways[run % 3:] + ways[:run % 3]:  # each goes first in turn
                    t = time.perf_counter()
                    upload()
                    times.append(time.perf_counter() - t)
                for prefix in (f"bench/jobs/{job}/", f"direct/{job}/", f"direct/{job}-same/"):  # moto: memory flat
                    keys = [o["Key"] for o in client.list_objects_v2(Bucket=args.bucket, Prefix=prefix)
                            .get("Contents", [])]
                    if keys:
                        client.delete_objects(Bucket=args.bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        mb = size / 2**20
        o, d, m = statistics.median(ours), statistics.median(direct), statistics.median(same)
        print(f"checkpoint: {len(files)} files, {mb:.0f} MiB; server: {'moto (loopback)' if server else 'given'}")
        print(f"ours   (store_sync.upload_newest): {mb / o:7.1f} MiB/s  (median of {args.runs}: {o:.2f} s)")
        print(f"direct (boto3 upload_file):        {mb / d:7.1f} MiB/s  (median of {args.runs}: {d:.2f} s)")
        print(f"direct (boto3, our TransferConfig):{mb / m:7.1f} MiB/s  (median of {args.runs}: {m:.2f} s)")
        print(f"ratio ours/direct (boto3 defaults): {d / o:.2f}; ours/direct (same transfer settings): {m / o:.2f}")
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
