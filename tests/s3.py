"""The object store for tests (issue 31): moto's S3 server on a free loopback port, and a store that is down for
its first few uploads, then back. Each test file keeps its own bucket."""

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import psutil

from service.storage import DirectoryStore, StoreUnavailable
from tests.helpers import free_port

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextmanager
def aws_at(endpoint: str) -> Iterator[None]:
    """The AWS variables point this process, and every process it starts, at `endpoint`; restored after."""
    saved = {k: os.environ.get(k) for k in (*AWS, "AWS_ENDPOINT_URL")}
    os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def moto_s3(bucket: str) -> Iterator[str]:
    """moto's S3 server in a thread of this process, with `bucket`: yields its endpoint."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    endpoint = f"http://127.0.0.1:{server._port}"
    try:
        with aws_at(endpoint):
            boto3.client("s3").create_bucket(Bucket=bucket)
            yield endpoint
    finally:
        server.stop()


def lose_machines(workers: list, folders: list[Path]) -> None:
    """kill -9 of each worker and every process under it (its work-horse, torchrun, the ranks), then its storage
    dir: the machines are gone with their disks. A process that died with its parent meanwhile is skipped."""
    tree = [p for w in workers for p in (psutil.Process(w.pid), *psutil.Process(w.pid).children(recursive=True))]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(tree, timeout=10)
    subprocess.run(["rm", "-rf", *map(str, folders)], check=True)


class DownThenBack(DirectoryStore):
    """A store that is down for its first `down` uploads (an outage during training), then back."""

    def __init__(self, root: Path, down: int):
        super().__init__(root)
        self.down = down

    def put_file(self, key, file):
        if self.down > 0:
            self.down -= 1
            raise StoreUnavailable(f"the store {self.url} is unreachable (upload {key}): connection refused")
        super().put_file(key, file)
