"""init_from with object storage (issue 31): a fine-tune starts from the weights of a job that ran on another
machine, fetched from the store (moto's S3 server on loopback) into the worker's own storage dir; a source with
nothing in the store is refused at submit, naming init_from.job."""

import io
import signal
import subprocess

import pytest

from service.settings import Settings
from service.storage import artifact_key, open_store
from service.storage.store import checkpoint_key
from service.storage.tree import upload_tree
from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for, wait_terminal
from tests.s3 import moto_s3
from tests.test_object_storage import checkpoint
from trainjobs.paths import new_job_id
from worker.store_init import fetch_init_source
from worker.store_sync import AttemptSync

BUCKET = "trainjobs-init"


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def test_init_from_fetches_only_what_the_store_holds_whole(tmp_path):
    (tmp_path / "store").mkdir()
    settings = Settings(data_dir=tmp_path, storage_dir=tmp_path / "cache", storage_url=f"file://{tmp_path}/store")
    store, job, source = open_store(settings), new_job_id(), tmp_path / "source"
    checkpoint(source, 100)
    assert AttemptSync(store, job_id=job, job_dir=source, keep=2, wait_s=1).upload_newest() == "step_00000100"
    half = checkpoint(source, 200)  # every file uploaded, its manifest never: not a checkpoint yet
    upload_tree(store, source / "checkpoints", half.name, lambda rel: checkpoint_key(job, half.name, rel))

    fetched = fetch_init_source(settings, job, "latest")
    assert fetched == tmp_path / "cache" / "jobs" / job / "checkpoints" / "step_00000100"
    assert (fetched / "__0_0.distcp").read_bytes() == (source / "checkpoints/step_00000100/__0_0.distcp").read_bytes()
    assert fetch_init_source(settings, job, "final") is None  # no model.pt in the store
    store.put_bytes(artifact_key(job, "model.pt"), b"weights")
    assert fetch_init_source(settings, job, "final").read_bytes() == b"weights"


def test_a_fine_tune_starts_from_the_weights_of_a_job_that_ran_on_another_worker(s3_endpoint, postgres_url, tmp_path):
    import torch

    dirs = {n: tmp_path / n for n in ("worker-a", "worker-b", "api")}
    with live_stack(postgres_url, tmp_path / "data", name="store-init", workers=0, storage_url=f"s3://{BUCKET}/init",
                    storage_dir=dirs["api"], store_wait_s=30) as stack:
        (first,) = stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-a"])})
        api = stack.client(timeout=10)
        train = {"max_steps": 20, "log_every": 5, "seed": 0, "checkpoint_every": 10}
        source = wait_terminal(api, api.post("/v1/jobs", json=mlp_spec(name="pretrain", train=train)).json()["id"])
        assert source["status"] == "succeeded", source["error"]
        failed = wait_terminal(api, api.post("/v1/jobs", json=mlp_spec(  # ends before any checkpoint or model.pt
            name="broken", max_retries=0, fault_injection={"raise_at_step": 0, "rank": 0})).json()["id"])
        assert failed["status"] == "failed"
        first.send_signal(signal.SIGINT)  # worker a leaves, and its disk with it: the store has what it stored
        first.wait(30)
        subprocess.run(["rm", "-rf", str(dirs["worker-a"])], check=True)

        (second,) = stack.add_workers(1, env={"TRAINJOBS_STORAGE_DIR": str(dirs["worker-b"])})
        wait_for(lambda: any(w["id"].endswith(f"-{second.pid}") and w["state"] != "lost"
                             for w in api.get("/v1/workers").json()["items"]), 30, what="worker b")
        still = {"optimizer": {"type": "sgd", "lr": 1e-12}, "train": {"max_steps": 2, "log_every": 1, "seed": 5}}
        answers = {which: api.post("/v1/jobs", json=mlp_spec(name=f"tune-{which}", **still, init_from={
            "job": source["id"], "checkpoint": which})) for which in ("final", "latest")}
        assert {which: a.status_code for which, a in answers.items()} == {"final": 201, "latest": 201}

        start = torch.load(io.BytesIO(api.get(f"/v1/jobs/{source['id']}/artifacts/model.pt").content),
                           weights_only=True)
        for which, answer in answers.items():
            job_id = answer.json()["id"]
            job = wait_terminal(api, job_id)
            assert job["status"] == "succeeded", job["error"]
            fetched = dirs["worker-b"] / "jobs" / source["id"]  # the source's folder in worker b's own cache
            assert f"[trainjobs] initialised the model from {fetched}" in api.get(f"/v1/jobs/{job_id}/logs").text
            # Two steps at lr 1e-12 change nothing: the fine-tune's weights are the source's (final = step 20 = latest)
            tuned = torch.load(dirs["worker-b"] / "jobs" / job_id / "artifacts" / "model.pt", weights_only=True)
            assert all(torch.allclose(tuned[k], v, atol=1e-9) for k, v in start.items()), which
        assert (fetched / "artifacts" / "model.pt").is_file()
        assert (fetched / "checkpoints" / "step_00000020" / "COMPLETE").is_file()

        for which in ("final", "latest"):  # the failed job stored neither: refused at submit, not at launch
            refused = api.post("/v1/jobs", json=mlp_spec(init_from={"job": failed["id"], "checkpoint": which}))
            assert refused.status_code == 422 and refused.json()["field"] == "init_from.job", refused.text
            assert "has no" in refused.json()["detail"]
        api.close()
