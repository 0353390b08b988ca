"""Object storage under faults (issue 31), against moto's S3 server run as a process of its own on loopback.

A store that stops answering while a job trains (the server paused with SIGSTOP: connections open, no answer,
as a store that is down or stuck looks to a client) and then comes back: the job trains on, its events say
its checkpoints wait and when the store is back, and it succeeds with nothing lost. A 2-node gang stores each
node's part of a checkpoint and a manifest only once both are in, whichever node global rank 0 runs on; killed
with both its workers and their local dirs deleted, it resumes on two new workers, each with a local dir of its
own path in a sandbox of its own, from the store; each node keeps only its newest copies, none still unstored.
A user's script's checkpoint counts once marked whole (COMPLETE, or DCP's .metadata).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from sqlalchemy import create_engine, select

from service.jobs.models import JobEvent
from service.storage import DirectoryStore, artifact_key, open_store
from service.storage.store import checkpoint_key, manifest_key, part_key
from tests.conftest import mlp_spec
from tests.helpers import free_port, live_stack, wait_for, wait_terminal
from tests.s3 import DownThenBack, aws_at, lose_machines
from trainjobs import paths
from trainjobs.paths import new_job_id
from worker.store_sync import BACK, WAITING, AttemptSync

BUCKET = "trainjobs-faults"


@pytest.fixture(scope="module")
def moto_process(tmp_path_factory):
    """moto's S3 server as a child process (so that it can be paused), with the bucket; the AWS variables
    point this process and every process it starts at it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        with aws_at(f"http://127.0.0.1:{port}"):
            wait_for(lambda: _bucket_made(), 60, interval=0.5, what="moto's server")
            yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _bucket_made() -> bool:
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
    except Exception:  # noqa: BLE001 - not listening yet
        return False
    return True


def job_events(url: str, job_id: str) -> list[tuple[str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            return [(kind, detail) for kind, detail in db.execute(
                select(JobEvent.kind, JobEvent.detail).where(JobEvent.job_id == job_id).order_by(JobEvent.id))]
    finally:
        engine.dispose()


def shard(job_dir: Path, step: int, node: int, *, complete: bool) -> Path:
    """One node's files of a checkpoint as DCP writes them: its ranks' shards; node 0 also the metadata."""
    folder = job_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"__{node}_0.distcp").write_bytes(os.urandom(500 + node))
    (folder / f"rng_rank{node}.pt").write_bytes(b"rng")
    if node == 0:
        (folder / ".metadata").write_bytes(b"meta")
    if complete:
        (folder / "COMPLETE").write_text("{}")
    return folder


def test_a_gang_checkpoint_counts_once_every_nodes_part_is_in_and_each_node_resumes_it_whole(tmp_path):
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    (tmp_path / "store").mkdir()
    nodes = [AttemptSync(store, job_id=job, job_dir=tmp_path / f"node{n}", keep=2, wait_s=1, node_rank=n, nnodes=2)
             for n in (0, 1)]
    shard(tmp_path / "node1", 100, 1, complete=False)
    assert nodes[1].upload_newest() is None  # node 0's part is not in: node 1 cannot know its files are whole
    shard(tmp_path / "node0", 100, 0, complete=True)
    assert nodes[0].upload_newest() == "step_00000100"
    assert store.head(manifest_key(job, "step_00000100")) is None  # one part of two: not a checkpoint yet
    assert nodes[1].upload_newest() == "step_00000100"  # node 1 sees both parts: it writes the manifest
    manifest = nodes[0].newest_manifest()
    assert sorted(manifest["files"]) == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt",
                                         "rng_rank1.pt"] and manifest["nodes"] == 2

    # Step 200: node 1 dies before storing its part. Step 100 stays the latest, for both nodes' resumes.
    shard(tmp_path / "node1", 200, 1, complete=False)
    shard(tmp_path / "node0", 200, 0, complete=True)
    assert nodes[0].upload_newest() == "step_00000200" and nodes[0].newest_manifest()["name"] == "step_00000100"
    for n in (0, 1):
        fresh = AttemptSync(store, job_id=job, job_dir=tmp_path / f"new{n}", keep=2, wait_s=1, node_rank=n, nnodes=2)
        assert fresh.restore() is None
        got = tmp_path / f"new{n}" / "checkpoints" / "step_00000100"
        assert sorted(p.name for p in got.iterdir()) == sorted(manifest["files"])
        assert not (tmp_path / f"new{n}" / "checkpoints" / "step_00000200").exists()

    # Retention: the manifests, files and parts of checkpoints past keep_checkpoints go.
    for step in (300, 400):
        shard(tmp_path / "node1", step, 1, complete=False)
        shard(tmp_path / "node0", step, 0, complete=True)
        nodes[0].upload_newest()
        nodes[1].upload_newest()
    assert [k.rsplit("/", 1)[1] for _, k in nodes[0]._manifests()] == ["step_00000300.json", "step_00000400.json"]
    assert not store.list(part_key(job, "step_00000100")) and not store.list(checkpoint_key(job, "step_00000200"))


def test_global_rank_0_on_node_1_leads_and_each_gang_node_keeps_only_its_newest_copies_none_unstored(tmp_path):
    """c10d may give global rank 0 (the mark, the metadata) to any node; every node drops its local copies past
    keep_checkpoints once it stored a newer part, but never one its part of is still to be stored."""
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    (tmp_path / "store").mkdir()
    nodes = [AttemptSync(store, job_id=job, job_dir=tmp_path / f"node{n}", keep=2, wait_s=1, node_rank=n, nnodes=2)
             for n in (0, 1)]
    local = [tmp_path / f"node{n}" / "checkpoints" for n in (0, 1)]

    def save(step: int) -> None:  # node 1 holds global rank 0's files; node 0 rank 1's
        shard(tmp_path / "node1", step, 0, complete=True)
        shard(tmp_path / "node0", step, 1, complete=False)

    for step in (100, 200):
        save(step)
        assert nodes[0].upload_newest() is None  # the lead's part is not in yet
        assert nodes[1].upload_newest() == nodes[0].upload_newest() == f"step_{step:08d}"
    assert nodes[1].newest_manifest()["name"] == "step_00000200"
    for step in (300, 400, 500):  # the lead's uploads lag (a slow store): node 0's parts wait, and are all kept
        save(step)
        assert nodes[0].upload_newest() is None
    assert sorted(os.listdir(local[0])) == [f"step_{s:08d}" for s in (100, 200, 300, 400, 500)]
    assert nodes[1].upload_newest() == nodes[0].upload_newest() == "step_00000500"
    for folder in local:  # 300 was never stored (each node stores its newest): gone with the older ones
        assert sorted(os.listdir(folder)) == ["step_00000400", "step_00000500"]
    manifest = nodes[0].newest_manifest()
    assert manifest["name"] == "step_00000500" and {"COMPLETE", ".metadata", "__1_0.distcp"} <= set(manifest["files"])


def test_an_earlier_attempts_unsealed_part_never_pairs_with_a_part_of_this_attempts(tmp_path):
    """Attempt 1's lead stored its part of step 200 and died with its peer: attempt 2 (node 1 on the same machine,
    node 0 on a fresh one) resumes from 100 and saves 200 again. Its node 0 must wait for the new lead's part, not
    pair with the old one (a checkpoint of two different saves)."""
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    (tmp_path / "store").mkdir()

    def sync(n: int, folder: str) -> AttemptSync:
        return AttemptSync(store, job_id=job, job_dir=tmp_path / folder, keep=2, wait_s=1, node_rank=n, nnodes=2)

    old = [sync(0, "old0"), sync(1, "node1")]
    for step in (100, 200):
        shard(tmp_path / "node1", step, 0, complete=True)
        shard(tmp_path / "old0", step, 1, complete=False)
        assert old[1].upload_newest() == f"step_{step:08d}"
        if step == 100:
            assert old[0].upload_newest() == "step_00000100"
    assert old[0].newest_manifest()["name"] == "step_00000100"  # then attempt 1 died: 200 is half in the store

    new = [sync(0, "new0"), sync(1, "node1")]
    for node in new:
        assert node.restore() is None
        node.start()
        node.close()  # the upload thread is driven by hand below
    shard(tmp_path / "new0", 200, 1, complete=False)  # attempt 2's node 0 saved 200 again
    assert new[1].upload_newest() is None  # node 1's 200 is attempt 1's, left on its disk: never stored
    assert new[0].upload_newest() is None  # and attempt 1's part of it is gone from the store
    time.sleep(0.05)  # a new folder, a new change time (coarse clock)
    shutil.rmtree(tmp_path / "node1" / "checkpoints" / "step_00000200")  # rank 0 saves 200 again
    shard(tmp_path / "node1", 200, 0, complete=True)
    assert new[1].upload_newest() == new[0].upload_newest() == "step_00000200"
    assert new[0].newest_manifest()["name"] == "step_00000200"


def test_a_scripts_checkpoint_counts_once_marked_by_complete_or_dcps_metadata(tmp_path):
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    (tmp_path / "store").mkdir()
    sync = AttemptSync(store, job_id=job, job_dir=tmp_path / "job", keep=2, wait_s=1, marks=paths.SCRIPT_MARKS)
    folder = tmp_path / "job" / "checkpoints"
    (folder / "step_00000010").mkdir(parents=True)
    (folder / "step_00000010" / "__0_0.distcp").write_bytes(b"half")  # DCP's files, not its .metadata yet
    (folder / "last.pt").write_bytes(b"not a checkpoint folder")
    assert sync.upload_newest() is None
    (folder / "step_00000010" / ".metadata").write_bytes(b"meta")
    assert sync.upload_newest() == "step_00000010"
    (folder / "step_00000020").mkdir()
    (folder / "step_00000020" / "model.pt").write_bytes(b"w")
    assert sync.upload_newest() is None
    (folder / "step_00000020" / "COMPLETE").write_text("20\n")  # trainjobs.complete_checkpoint's mark
    assert sync.upload_newest() == "step_00000020"
    assert sorted(sync.newest_manifest()["files"]) == ["COMPLETE", "model.pt"]


def test_the_jobs_events_say_once_that_its_checkpoints_wait_for_the_store_and_when_it_is_back(tmp_path):
    store, notes = DownThenBack(tmp_path / "store", down=4), []
    (tmp_path / "store").mkdir()
    sync = AttemptSync(store, job_id=new_job_id(), job_dir=tmp_path / "job", keep=2, wait_s=30,
                       note=lambda kind, detail: notes.append((kind, detail)))
    shard(tmp_path / "job", 100, 0, complete=True)
    sync.start()
    try:
        wait_for(lambda: sync.stored_step == 100, 30, what="the checkpoint stored once the store is back")
    finally:
        assert sync.finish(succeeded=True) is None
    assert [k for k, _ in notes] == [WAITING, BACK]
    assert store.url in notes[0][1] and "trains on" in notes[0][1] and "step_00000100" in notes[1][1]


def test_an_attempt_that_merely_sees_its_lease_run_out_waits_for_it_before_storing_its_outcome(tmp_path):
    """A renewal the database was slow for must not make a job succeed without its artifacts in the store; a lease
    really lost stores nothing (another attempt has the job)."""
    store, job = DirectoryStore(tmp_path / "store"), new_job_id()
    (tmp_path / "store").mkdir()
    (tmp_path / "job" / "artifacts").mkdir(parents=True)
    (tmp_path / "job" / "artifacts" / "model.pt").write_bytes(b"w")
    confirmed_at, ticks = time.monotonic() + 1.5, []
    sync = AttemptSync(store, job_id=job, job_dir=tmp_path / "job", keep=2, wait_s=30,
                       stale=lambda: time.monotonic() < confirmed_at, alive=lambda: ticks.append(1))
    assert sync.finish(succeeded=True) is None and time.monotonic() >= confirmed_at
    assert store.head(artifact_key(job, "model.pt")) is not None and ticks  # the lease kept ticking meanwhile
    other = new_job_id()
    lost = AttemptSync(store, job_id=other, job_dir=tmp_path / "job", keep=2, wait_s=30, stale=lambda: True,
                       lost=lambda: True)
    assert lost.finish(succeeded=True) is None and not store.list(artifact_key(other))


def test_a_store_paused_while_the_job_trains_delays_its_checkpoints_and_loses_nothing(moto_process, postgres_url,
                                                                                      tmp_path):
    url = f"s3://{BUCKET}/paused"
    with live_stack(postgres_url, tmp_path / "data", name="store-paused", workers=0, storage_url=url,
                    storage_dir=tmp_path / "api", store_timeout_s=1, store_wait_s=60) as stack:
        stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(tmp_path / "worker")})
        api = stack.client(timeout=10)
        spec = mlp_spec(name="store-paused", fault_injection={"sleep_per_step_s": 0.01, "rank": 0},
                        train={"max_steps": 1500, "log_every": 50, "checkpoint_every": 250, "keep_checkpoints": 3})
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        probe = AttemptSync(open_store(stack.settings), job_id=job_id, job_dir=tmp_path / "probe", keep=3, wait_s=1)
        wait_for(lambda: (m := probe.newest_manifest()) and m["step"] >= 250, 120, what="a first stored checkpoint")
        moto_process.send_signal(signal.SIGSTOP)  # the store stops answering: connections hang, then time out
        try:
            wait_for(lambda: WAITING in [k for k, _ in job_events(postgres_url, job_id)], 60,
                     what="the job's event saying its checkpoints wait")
            paused_at = api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"]
            wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] >= paused_at + 100, 60,
                     what="training going on while the store is down")
        finally:
            moto_process.send_signal(signal.SIGCONT)
        job = wait_terminal(api, job_id, timeout=180)
        assert job["status"] == "succeeded", job["error"]
        kinds = [k for k, _ in job_events(postgres_url, job_id)]
        assert kinds.count(WAITING) == 1 and BACK in kinds[kinds.index(WAITING):]
        # Nothing lost: the job's last checkpoint is stored whole (those the outage skipped were superseded), the
        # ones kept are at most keep_checkpoints, and its model is served.
        manifests = [json.loads(probe.store.get_bytes(key)) for _, key in probe._manifests()]
        assert manifests[-1]["step"] == 1500 and len(manifests) <= 3
        for m in manifests:
            assert {o.key.rsplit("/", 1)[1]: o.size for o in probe.store.list(checkpoint_key(job_id, m["name"]))
                    } == {rel.rsplit("/", 1)[-1]: size for rel, size in m["files"].items()}
        assert api.get(f"/v1/jobs/{job_id}/artifacts/model.pt").content == \
            (tmp_path / "worker" / "jobs" / job_id / "artifacts" / "model.pt").read_bytes()
        api.close()


def test_a_two_node_gang_killed_with_its_workers_resumes_each_nodes_shards_from_the_store(moto_process, postgres_url,
                                                                                          tmp_path):
    url, dirs = f"s3://{BUCKET}/gang", {n: tmp_path / n for n in ("a0", "a1", "b0", "b1", "api")}
    # Each worker its own TRAINJOBS_STORAGE_DIR path, each node in its own sandbox: no node sees another's folder.
    with live_stack(postgres_url, tmp_path / "data", name="store-gang", workers=0, storage_url=url,
                    storage_dir=dirs["api"], lease_s=4.0, heartbeat_s=0.5, sweep_s=0.5, gang_timeout_s=20,
                    store_wait_s=30) as stack:
        first = [stack.add_workers(1, ["--slots", "1"], env={"TRAINJOBS_STORAGE_DIR": str(dirs[n])})[0]
                 for n in ("a0", "a1")]
        api = stack.client(timeout=10)
        spec = mlp_spec(name="store-gang", resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"},
                        max_retries=1, fault_injection={"sleep_per_step_s": 0.01, "rank": 0},
                        train={"max_steps": 1200, "log_every": 50, "checkpoint_every": 200, "keep_checkpoints": 2})
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        probe = AttemptSync(open_store(stack.settings), job_id=job_id, job_dir=tmp_path / "probe", keep=2, wait_s=1)
        wait_for(lambda: (m := probe.newest_manifest()) and m["step"] >= 400, 180, what="a gang checkpoint stored")
        stored = probe.newest_manifest()
        assert {"__0_0.distcp", "__1_0.distcp", "COMPLETE"} <= set(stored["files"])  # both nodes' shards
        lose_machines(first, [dirs["a0"], dirs["a1"]])  # both machines gone, with their disks

        for n in ("b0", "b1"):
            stack.add_workers(1, ["--slots", "1"], env={"TRAINJOBS_STORAGE_DIR": str(dirs[n])})
        job = wait_terminal(api, job_id, timeout=240)
        assert job["status"] == "succeeded", job["error"]
        second = [a for a in api.get(f"/v1/jobs/{job_id}/attempts").json()["data"] if a["status"] == "succeeded"]
        assert sorted(a["node_rank"] for a in second) == [0, 1]
        resumed = {a["resumed_from_step"] for a in second}
        assert len(resumed) == 1 and resumed.pop() >= stored["step"]
        # Each node, in a sandbox of its own, loaded the checkpoint from its own dir (fetched whole before its ranks
        # began), and keeps only the newest keep_checkpoints of its own copies (global rank 0 prunes one node's).
        for n in ("b0", "b1"):
            assert sorted(os.listdir(dirs[n] / "jobs" / job_id / "checkpoints")) == ["step_00001000", "step_00001200"]
        assert probe.newest_manifest()["step"] == 1200 and len(probe._manifests()) == 2
        api.close()
