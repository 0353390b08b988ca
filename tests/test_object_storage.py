"""Object storage (issue 31) against a real S3 HTTP server on loopback: moto's server mode.

The backends (directory and S3) behind one interface, keys that cannot leave a job's prefix, a checkpoint that
counts only once its manifest is written, the start checks; and end to end, a job whose worker is killed with
kill -9 (every process of it) and its local storage dir deleted resumes on a second worker with a storage dir of
its own from the store's checkpoint, and its artifacts download through an API whose storage dir is a third; so
does a user's own script (entrypoint) that saves its checkpoints with the SDK's helpers and DCP.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainjobs
from service.settings import Settings
from service.storage import DirectoryStore, StoreUnavailable, artifact_key, open_store
from service.storage.store import checkpoint_key, manifest_key
from service.storage.tree import upload_tree
from tests.conftest import mlp_spec
from tests.helpers import free_port, live_stack, processes_of, wait_for, wait_terminal
from tests.s3 import AWS, DownThenBack, lose_machines, moto_s3
from trainjobs.errors import InvalidRequest
from trainjobs.paths import new_job_id
from worker import sandbox
from worker.store_init import _fetch_model
from worker.store_sync import AttemptSync

BUCKET = "trainjobs-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free loopback port, with the bucket; the AWS variables point every process at it."""
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(params=["directory", "s3"])
def store(request, tmp_path):
    if request.param == "directory":
        return DirectoryStore(tmp_path / "store")
    request.getfixturevalue("s3_endpoint")
    return open_store(Settings(storage_url=f"s3://{BUCKET}/unit-{tmp_path.name}"))


def test_a_store_puts_gets_lists_reads_ranges_and_deletes(store, tmp_path):
    job = new_job_id()
    (tmp_path / "store").mkdir(exist_ok=True)
    store.check()
    key = artifact_key(job, "sub/out.bin")
    store.put_bytes(key, b"0123456789")
    store.put_bytes(artifact_key(job, "a.txt"), b"a")
    assert [(o.key, o.size) for o in store.list(artifact_key(job))] == [(artifact_key(job, "a.txt"), 1), (key, 10)]
    assert b"".join(store.read(key, 2, 5)) == b"2345" and b"".join(store.read(key, 7)) == b"789"
    store.get_file(key, tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == b"0123456789" and store.head(key).size == 10
    store.delete([key, artifact_key(job, "never-there")])
    assert store.head(key) is None and [o.key for o in store.list(artifact_key(job))] == [artifact_key(job, "a.txt")]
    with pytest.raises(FileNotFoundError):
        list(store.read(key))


@pytest.mark.parametrize("name", ["../x", "a/../../b", "/etc/passwd", "a//b", ".", "a\\..\\b", "a/\0"])
def test_a_key_never_leaves_the_jobs_prefix(name, tmp_path):
    job = new_job_id()
    with pytest.raises(InvalidRequest):
        artifact_key(job, name)
    with pytest.raises(InvalidRequest):
        checkpoint_key(job, name)
    with pytest.raises(InvalidRequest):
        artifact_key("../" + job[3:], "model.pt")  # not a job id
    with pytest.raises(InvalidRequest):  # however a key was made, the store checks it again
        DirectoryStore(tmp_path).put_bytes(f"jobs/{job}/{name}", b"x")


def checkpoint(job_dir: Path, step: int, *, complete: bool = True) -> Path:
    folder = job_dir / "checkpoints" / f"step_{step:08d}"
    (folder / "sub").mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(1000 + step))
    (folder / "sub" / "trainer.json").write_text(json.dumps({"step": step}))
    if complete:
        (folder / "COMPLETE").write_text("{}")
    return folder


def test_only_a_checkpoint_with_its_manifest_is_the_latest_and_retention_keeps_k(s3_endpoint, tmp_path):
    store, job = open_store(Settings(storage_url=f"s3://{BUCKET}/manifests")), new_job_id()
    first = tmp_path / "first"
    sync = AttemptSync(store, job_id=job, job_dir=first, keep=2, wait_s=1)
    for step in (100, 200, 300):
        checkpoint(first, step)
        assert sync.upload_newest() == f"step_{step:08d}"
    assert [k.rsplit("/", 1)[1] for _, k in sync._manifests()] == ["step_00000200.json", "step_00000300.json"]
    assert not store.list(checkpoint_key(job, "step_00000100"))  # its files went with its manifest
    # An upload cut off before its manifest: every file there, no manifest. It never becomes the latest.
    half = checkpoint(first, 400)
    upload_tree(store, first / "checkpoints", half.name, lambda rel: checkpoint_key(job, half.name, rel))
    assert store.head(checkpoint_key(job, half.name, "COMPLETE")) is not None
    second = tmp_path / "second"
    resumed = AttemptSync(store, job_id=job, job_dir=second, keep=2, wait_s=1)
    assert resumed.restore() is None
    restored = second / "checkpoints" / "step_00000300"
    assert sorted(p.relative_to(restored).as_posix() for p in restored.rglob("*") if p.is_file()) == \
        ["COMPLETE", "__0_0.distcp", "sub/trainer.json"]
    assert (restored / "__0_0.distcp").read_bytes() == (first / "checkpoints/step_00000300/__0_0.distcp").read_bytes()
    assert not (second / "checkpoints" / "step_00000400").exists()
    # A local checkpoint without COMPLETE is never uploaded either (nor the one just fetched, again).
    checkpoint(second, 500, complete=False)
    assert resumed.upload_newest() is None


def test_a_restore_and_an_init_from_fetch_write_nothing_through_links_the_job_left(tmp_path):
    """A job's earlier attempt planted links where the worker (root) puts what it fetches: replaced, not followed."""
    (tmp_path / "store").mkdir()
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    first = tmp_path / "storage" / "jobs" / job
    sync = AttemptSync(store, job_id=job, job_dir=first, keep=2, wait_s=1)
    checkpoint(first, 100)
    assert sync.upload_newest() == "step_00000100"
    store.put_bytes(artifact_key(job, "model.pt"), b"the job's weights")
    victim = tmp_path / "victim"
    victim.mkdir()
    second = tmp_path / "other-machine" / "jobs" / job
    (second / "checkpoints").mkdir(parents=True)
    (second / "artifacts").mkdir()
    (second / "checkpoints" / "step_00000100").symlink_to(victim)
    (second / "artifacts" / "model.pt").symlink_to(victim / "model.pt")
    # Where the worker once staged its downloads, in the job's own folders, under names a job could guess.
    (second / "checkpoints" / ".restore-step_00000100-node0").symlink_to(victim)
    (second / "artifacts" / f".fetch-model.pt-{os.getpid()}").symlink_to(victim / "staged.pt")
    assert AttemptSync(store, job_id=job, job_dir=second, keep=2, wait_s=1).restore() is None
    restored = second / "checkpoints" / "step_00000100"
    assert not restored.is_symlink() and (restored / "COMPLETE").is_file()
    _fetch_model(store, job, second)
    assert not (second / "artifacts" / "model.pt").is_symlink()
    assert (second / "artifacts" / "model.pt").read_bytes() == b"the job's weights"
    assert list(victim.iterdir()) == []


def test_a_store_down_while_the_ranks_train_gets_the_checkpoint_once_it_is_back(tmp_path):
    store, job = DownThenBack(tmp_path / "store", down=3), new_job_id()
    (tmp_path / "store").mkdir()
    sync = AttemptSync(store, job_id=job, job_dir=tmp_path / "job", keep=2, wait_s=10)
    sync.start()  # the background thread: it meets the outage, backs off, tries again
    checkpoint(tmp_path / "job", 100)
    try:
        wait_for(lambda: sync.stored_step == 100, 20, what="the checkpoint stored after the outage")
    finally:
        assert sync.finish(succeeded=True) is None
    assert sync.newest_manifest()["files"] == {"COMPLETE": 2, "__0_0.distcp": 1100, "sub/trainer.json": 13}


def test_a_link_planted_among_artifacts_is_not_uploaded(s3_endpoint, tmp_path):
    store, job = open_store(Settings(storage_url=f"s3://{BUCKET}/links")), new_job_id()
    artifacts = tmp_path / "job" / "artifacts"
    artifacts.mkdir(parents=True)
    (artifacts / "model.pt").write_bytes(b"weights")
    (artifacts / "secret").symlink_to("/etc/hostname")
    (artifacts / "dir").symlink_to("/etc", target_is_directory=True)
    assert AttemptSync(store, job_id=job, job_dir=tmp_path / "job", keep=2, wait_s=1).upload_artifacts() == 1
    assert [o.key for o in store.list(artifact_key(job))] == [artifact_key(job, "model.pt")]


def test_a_store_out_of_reach_fails_a_succeeded_attempt_naming_it_after_the_bounded_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for key, value in AWS.items():
        monkeypatch.setenv(key, value)
    store = open_store(Settings(storage_url="s3://nowhere/x", store_timeout_s=0.5))
    (tmp_path / "job" / "artifacts").mkdir(parents=True)
    (tmp_path / "job" / "artifacts" / "model.pt").write_bytes(b"w")
    sync = AttemptSync(store, job_id=new_job_id(), job_dir=tmp_path / "job", keep=2, wait_s=1)
    assert sync.finish(succeeded=False) is None  # a failed attempt stays failed for its own reason
    error = sync.finish(succeeded=True)
    assert error["type"] == "store_unavailable" and "s3://nowhere/x" in error["message"]


def test_the_worker_and_the_api_refuse_to_start_on_a_missing_bucket(s3_endpoint, tmp_path):
    env = {**os.environ, "TRAINJOBS_STORAGE_URL": "s3://no-such-bucket/p", "TRAINJOBS_DATA_DIR": str(tmp_path),
           "TRAINJOBS_AUTH": "off", "TRAINJOBS_SANDBOX": "off"}
    with pytest.raises(StoreUnavailable, match="s3://no-such-bucket/p"):
        open_store(Settings(storage_url="s3://no-such-bucket/p")).check()
    worker = subprocess.run([sys.executable, "-m", "worker.main"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert worker.returncode != 0 and "trainjobs worker: the store s3://no-such-bucket/p" in worker.stderr
    assert "there is no bucket 'no-such-bucket'" in worker.stderr
    api = subprocess.run([sys.executable, "-m", "uvicorn", "service.api.asgi:app", "--port", str(free_port())],
                         env=env, capture_output=True, text=True, timeout=60)
    assert api.returncode != 0 and "trainjobs api: the store s3://no-such-bucket/p" in api.stderr


def test_no_aws_variable_reaches_a_job():
    env = {"PATH": "/bin", **AWS, "AWS_ENDPOINT_URL": "http://x", "TRAINJOBS_STORAGE_URL": "s3://b/p"}
    assert sandbox.job_env(Settings(), env) == {"PATH": "/bin"}


def lose_once_stored(stack, job_id: str, probe: Path, *, step: int, worker, folder: Path) -> int:
    """Once the store holds a checkpoint of `step` or later, the worker's machine is lost: kill -9 of its every
    process, its storage dir deleted. Returns the newest stored step (the least a resume may start from)."""
    sync = AttemptSync(open_store(stack.settings), job_id=job_id, job_dir=probe, keep=2, wait_s=1)
    wait_for(lambda: (m := sync.newest_manifest()) and m["step"] >= step, 90, what="a checkpoint in the store")
    ranks = processes_of(job_id)
    assert ranks and not any(k.startswith("AWS_") or k == "TRAINJOBS_STORAGE_URL" for p in ranks
                             for k in p.environ())  # no credentials in the job's sandbox
    lose_machines([worker], [folder])
    return sync.newest_manifest()["step"]


def test_a_job_killed_with_its_worker_resumes_on_another_from_the_store(s3_endpoint, postgres_url, tmp_path):
    dirs = {n: tmp_path / n for n in ("worker-a", "worker-b", "api")}
    url = f"s3://{BUCKET}/e2e"
    with live_stack(postgres_url, tmp_path / "data", name="store", workers=0, storage_url=url,
                    storage_dir=dirs["api"], lease_s=4.0, heartbeat_s=0.5, sweep_s=0.5, store_wait_s=30) as stack:
        (first,) = stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-a"])})
        api = stack.client(timeout=10)
        spec = mlp_spec(name="store-resume", max_retries=1,  # the first attempt slowed: it still runs when killed
                        fault_injection={"sleep_per_step_s": 0.02, "rank": 0, "attempt": 1},
                        data={"type": "synthetic_regression", "num_samples": 4096, "batch_size": 16},
                        train={"max_steps": 2000, "log_every": 100, "checkpoint_every": 300, "keep_checkpoints": 2})
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        stored_step = lose_once_stored(stack, job_id, tmp_path / "probe", step=600, worker=first,
                                       folder=dirs["worker-a"])

        stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-b"])})
        job = wait_terminal(api, job_id, timeout=120)
        assert job["status"] == "succeeded", job["error"]
        lost, second = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
        assert lost["status"] == "lost" and second["status"] == "succeeded"
        assert second["resumed_from_step"] >= stored_step > 0
        assert (dirs["worker-b"] / "jobs" / job_id / "checkpoints").is_dir()

        # The API's own storage dir holds nothing of the job: its artifacts come from the store.
        assert not (dirs["api"] / "jobs" / job_id).exists()
        listed = api.get(f"/v1/jobs/{job_id}/artifacts").json()
        assert "model.pt" in [a["name"] for a in listed["data"]]
        got = api.get(f"/v1/jobs/{job_id}/artifacts/model.pt")
        assert got.status_code == 200
        assert got.content == (dirs["worker-b"] / "jobs" / job_id / "artifacts" / "model.pt").read_bytes()
        assert api.get(f"/v1/jobs/{job_id}/artifacts/..%2F..%2Fsecret").status_code in (404, 422)
        assert len(open_store(stack.settings).list(manifest_key(job_id))) == 2  # retention: the last K
        api.close()


def test_the_sdk_names_marks_and_finds_a_scripts_checkpoints(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINJOBS_CHECKPOINT_DIR", raising=False)
    assert trainjobs.checkpoint_path(5) is None and trainjobs.latest_checkpoint() is None  # outside the service
    monkeypatch.setenv("TRAINJOBS_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    first, second = trainjobs.checkpoint_path(5), trainjobs.checkpoint_path(40)
    assert first == tmp_path / "step_00000005" and first.is_dir() and trainjobs.latest_checkpoint() is None
    trainjobs.complete_checkpoint(first)
    (second / ".metadata").write_bytes(b"DCP's, written last")
    assert trainjobs.latest_checkpoint() == second
    monkeypatch.setenv("RANK", "1")  # another rank: global rank 0 alone writes the mark
    trainjobs.complete_checkpoint(trainjobs.checkpoint_path(50))
    assert trainjobs.latest_checkpoint() == second
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="checkpoint_path"):
        trainjobs.complete_checkpoint(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="step"):
        trainjobs.checkpoint_path(-1)


# A user's script: its state after step s is s (every rank), saved with DCP into trainjobs.checkpoint_path and marked
# whole with trainjobs.complete_checkpoint; it resumes from trainjobs.latest_checkpoint. Its first attempt is slow.
SAVES_CHECKPOINTS = """import os, time
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import trainjobs

STEPS, EVERY = 300, 25
dist.init_process_group("gloo")
state, start = {"weight": torch.zeros(4)}, 0
if (latest := trainjobs.latest_checkpoint()) is not None:
    dcp.load(state, checkpoint_id=latest)
    start = int((latest / "step.txt").read_text())
    print(f"resumed from {latest.name}", flush=True)
for step in range(start + 1, STEPS + 1):
    state["weight"] += 1
    time.sleep(0.05 if os.environ["TRAINJOBS_ATTEMPT"] == "1" else 0)
    trainjobs.report(step=step, loss=1.0 / step, total_steps=STEPS)
    if step % EVERY == 0:
        path = trainjobs.checkpoint_path(step)
        if dist.get_rank() == 0:
            (path / "step.txt").write_text(str(step))
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        trainjobs.complete_checkpoint(path)
trainjobs.summary(started_at=start, weight=state["weight"][0].item())
dist.destroy_process_group()
"""


def test_a_scripts_checkpoints_are_stored_and_it_resumes_from_them_on_another_worker(s3_endpoint, postgres_url,
                                                                                     tmp_path):
    dirs = {n: tmp_path / n for n in ("worker-a", "worker-b", "api", "scripts")}
    dirs["scripts"].mkdir()
    (dirs["scripts"] / "saves.py").write_text(SAVES_CHECKPOINTS)
    with live_stack(postgres_url, tmp_path / "data", name="store-script", workers=0, storage_url=f"s3://{BUCKET}/sdk",
                    storage_dir=dirs["api"], lease_s=4.0, heartbeat_s=0.5, sweep_s=0.5, store_wait_s=30,
                    allow_entrypoints=True, scripts_dir=dirs["scripts"]) as stack:
        (first,) = stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-a"])})
        api = stack.client(timeout=10)
        spec = mlp_spec(name="script-resume", model=None, data=None, entrypoint={"script": "saves.py"},
                        max_retries=1, train={"keep_checkpoints": 2})
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        stored_step = lose_once_stored(stack, job_id, tmp_path / "probe", step=100, worker=first,
                                       folder=dirs["worker-a"])

        stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-b"])})
        job = wait_terminal(api, job_id, timeout=120)
        assert job["status"] == "succeeded", job["error"]
        assert job["summary"]["started_at"] >= stored_step > 0 and job["summary"]["weight"] == 300
        assert f"resumed from step_{job['summary']['started_at']:08d}" in api.get(f"/v1/jobs/{job_id}/logs").text
        names = [m.key.rsplit("/", 1)[1] for m in open_store(stack.settings).list(manifest_key(job_id))]
        assert names[-1] == "step_00000300.json" and len(names) <= 2  # retention: keep_checkpoints
        api.close()
