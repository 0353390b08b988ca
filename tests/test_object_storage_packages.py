"""Packages in the object store (issue 31): a worker that shares no folder with the API fetches a job's package
from the store, checks its digest and runs it; a store that gives other bytes is refused."""

import hashlib
import os

import pytest

from service.packages import stored
from service.settings import Settings
from service.storage import StoreUnavailable, open_store
from service.storage.store import package_key
from tests.helpers import live_stack
from tests.s3 import moto_s3
from trainjobs import Client

BUCKET = "trainjobs-packages"

SCRIPT = "from trainjobs import report, summary\nreport(step=1, loss=0.5, total_steps=1)\nsummary(steps=1)\n" \
         "print('package ran from', __file__, flush=True)\n"


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def test_a_worker_without_the_apis_folder_runs_a_package_fetched_from_the_store(s3_endpoint, postgres_url, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the SDK's digest cache: the test's own
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    api_dir, worker_dir = tmp_path / "api-storage", tmp_path / "worker-storage"
    with live_stack(postgres_url, tmp_path / "data", name="store-packages", workers=0, allow_entrypoints=True,
                    storage_url=f"s3://{BUCKET}/pool", storage_dir=api_dir) as stack:
        stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(worker_dir)})
        with Client(stack.api_url, token=stack.token) as client:
            digest = client.upload_package(project)
            hex_digest = digest.removeprefix("sha256:")
            store = open_store(stack.settings)
            kept = api_dir / "packages" / f"{hex_digest}.tar.gz"
            assert store.head(package_key(digest)).size == kept.stat().st_size
            assert not (worker_dir / "packages").exists()
            job = client.submit({"name": "from-store", "resources": {"nproc_per_node": 1},
                                 "entrypoint": {"script": "train.py"}}, workdir=project)
            job = client.wait(job["id"], timeout=180)
            assert job["status"] == "succeeded", job["error"]
            assert "package ran from" in client.logs(job["id"])
            fetched = worker_dir / "packages" / f"{hex_digest}.tar.gz"  # this machine's cache of it, checked
            assert hashlib.sha256(fetched.read_bytes()).hexdigest() == hex_digest

            client.delete_package(digest)
            assert store.head(package_key(digest)) is None  # the last owner's delete takes it from the store


def test_a_package_the_store_gives_with_other_bytes_is_refused(s3_endpoint, tmp_path):
    settings = Settings(storage_url=f"s3://{BUCKET}/tampered", storage_dir=tmp_path / "storage")
    digest = "sha256:" + hashlib.sha256(b"the real package").hexdigest()
    open_store(settings).put_bytes(package_key(digest), b"something else")
    dest = tmp_path / "storage" / "packages" / "x.tar.gz"
    with pytest.raises(StoreUnavailable, match="another digest"):
        stored.fetch(settings, digest, dest)
    assert not dest.exists() and os.listdir(dest.parent) == []  # nothing left half-way
    assert stored.fetch(settings, "sha256:" + "0" * 64, dest) is False  # none in the store: unavailable
