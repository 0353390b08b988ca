"""Working with runs you already have (issue 17, first part): find jobs by name and tag, clone one with changes,
take its metrics out as CSV, and the CLI's resubmit, metrics and artifacts."""

import csv
import io
import json
import os
import subprocess
import sys

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.db import utcnow
from service.metrics import service as metrics
from tests.conftest import mlp_spec
from tests.helpers import count_jobs, module_stack, wait_terminal


def store(db_url: str, job_id: str, rows: list[tuple[int, str, float]], node_rank: int = 0) -> None:
    engine = create_engine(db_url)
    with Session(engine) as db:
        metrics.insert_batch(db, job_id=job_id, attempt=1, node_rank=node_rank,
                             rows=[(s, n, v, utcnow()) for s, n, v in rows])
        db.commit()
    engine.dispose()


def test_the_list_filters_by_name_prefix_and_by_tag(client):
    made = {name: client.post("/v1/jobs", json=mlp_spec(name=name, tags=tags)).json()["id"]
            for name, tags in (("lr-study-1", ["study=lr", "team=vision"]), ("lr-study-2", ["study=lr"]),
                               ("baseline", ["team=vision"]), ("lr_other", []))}

    def names(**params):
        return [j["name"] for j in client.get("/v1/jobs", params=params).json()["items"]]

    assert names(name="lr-study") == ["lr-study-2", "lr-study-1"]  # newest first
    assert names(name="lr_") == ["lr_other"]  # "_" is a character here, not LIKE's wildcard
    assert names(tag="team=vision") == ["baseline", "lr-study-1"]
    assert names(tag="study=lr", name="lr-study-1") == ["lr-study-1"]
    assert names(tag="nobody") == [] and len(made) == 4
    assert client.get("/v1/jobs", params={"tag": "x" * 65}).status_code == 422


def test_a_clone_is_the_old_spec_changed_and_names_its_source(client, settings):
    source = client.post("/v1/jobs", json=mlp_spec(name="base", tags=["study=lr"])).json()
    response = client.post(f"/v1/jobs/{source['id']}/clone",
                           json={"set": {"optimizer.lr": 3e-4, "train.seed": 7, "name": "base-lr3e-4"}})
    assert response.status_code == 201, response.text
    clone = response.json()
    assert clone["cloned_from"] == source["id"] and clone["id"] != source["id"]
    assert clone["spec"]["optimizer"]["lr"] == 3e-4 and clone["spec"]["train"]["seed"] == 7
    assert clone["name"] == "base-lr3e-4" and clone["status"] == "queued"
    assert {k: v for k, v in clone["spec"].items() if k not in ("optimizer", "train", "name")} == \
        {k: v for k, v in source["spec"].items() if k not in ("optimizer", "train", "name")}
    assert [j["id"] for j in client.get("/v1/jobs", params={"tag": "study=lr"}).json()["items"]] == \
        [clone["id"], source["id"]]  # the clone keeps the tags
    before = count_jobs(settings.database_url)
    for change, field, says in (({"optimizer.lrr": 1}, "set.optimizer.lrr", "not a field"),
                                ({"fault_injection.rank": 1}, "set.fault_injection.rank", "not set in the source"),
                                ({"optimizer.lr": -1}, "set.optimizer.lr", "greater than"),
                                ({"train.max_steps": "many"}, "set.train.max_steps", "integer")):
        refused = client.post(f"/v1/jobs/{source['id']}/clone", json={"set": change})
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
        assert says in refused.json()["detail"]
    assert count_jobs(settings.database_url) == before
    assert client.post("/v1/jobs/0123456789abcdef0123/clone", json={}).status_code == 404


def test_metrics_as_csv_are_every_stored_point(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    store(settings.database_url, job["id"], [(s, "loss", 1 / s) for s in range(1, 7001)] + [(1, "lr", 0.01)])
    store(settings.database_url, job["id"], [(1, "peak_mem_mb", 250.0)], node_rank=1)
    response = client.get(f"/v1/jobs/{job['id']}/metrics", params={"format": "csv"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert len(rows) == 7002 and list(rows[0]) == ["step", "name", "value", "node_rank", "attempt", "time"]
    loss = [r for r in rows if r["name"] == "loss"]
    assert [int(r["step"]) for r in loss] == list(range(1, 7001))  # past the 5,000-row batch
    assert float(loss[2]["value"]) == 1 / 3  # the value exactly, not rounded
    assert {r["node_rank"] for r in rows} == {"0", "1"} and rows[0]["time"].endswith("Z")
    only = client.get(f"/v1/jobs/{job['id']}/metrics", params={"format": "csv", "name": "lr"}).text.splitlines()
    assert len(only) == 2 and only[1].startswith("1,lr,0.01,0,1,")
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"format": "xml"}).status_code == 422


stack = module_stack("experiments")


def cli(stack, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token)
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_the_cli_resubmits_with_changes_and_takes_out_metrics_and_artifacts(stack, api, tmp_path):
    job = wait_terminal(api, api.post("/v1/jobs", json=mlp_spec(name="cli-source")).json()["id"])
    assert job["status"] == "succeeded", job["error"]

    out = cli(stack, "metrics", job["id"], "--name", "loss", "--csv")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "step,name,value,node_rank,attempt,time" and [ln.split(",")[0] for ln in lines[1:]] == \
        ["5", "10", "15", "20"]
    table = cli(stack, "metrics", job["id"])
    assert table.returncode == 0 and "loss" in table.stdout and "samples_per_s" in table.stdout

    listed = cli(stack, "artifacts", job["id"], "--json")
    assert "model.pt" in [f["name"] for f in json.loads(listed.stdout)]
    saved = cli(stack, "artifacts", job["id"], "--download", "model.pt", "--to", str(tmp_path))
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "model.pt").stat().st_size > 0

    again = cli(stack, "resubmit", job["id"], "--set", "optimizer.lr=0.02", "--set", "name=cli-clone", "--json")
    assert again.returncode == 0, again.stderr
    clone = json.loads(again.stdout)
    assert clone["cloned_from"] == job["id"] and clone["spec"]["optimizer"]["lr"] == 0.02
    bad = cli(stack, "resubmit", job["id"], "--set", "optimizer.lrr=1")
    assert bad.returncode != 0 and "optimizer.lrr" in bad.stdout + bad.stderr
    found = cli(stack, "list", "--name", "cli-", "--json")
    assert [j["name"] for j in json.loads(found.stdout)["items"]] == ["cli-clone", "cli-source"]
    wait_terminal(api, clone["id"])


def test_the_migration_fills_in_the_tags_of_jobs_already_stored(tmp_path):
    from sqlalchemy import insert, select

    from service import migrate
    from service.jobs import service as jobs
    from service.jobs.models import Job, JobTag
    from trainjobs.paths import new_job_id
    from trainjobs.spec import JobSpec

    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0013")
    engine = create_engine(url)
    made = {}
    with engine.begin() as db:
        for tags in (["team=a", "study=lr", "team=a"], [], ["team=b"]):
            spec, job_id = JobSpec.model_validate(mlp_spec(tags=tags)), new_job_id()
            db.execute(insert(Job.__table__).values(id=job_id, name=spec.name, spec=spec, status="queued",
                                                    spec_hash=jobs.hash_spec(spec), priority="normal",
                                                    created_at=utcnow()))
            made[job_id] = sorted(set(tags))
    migrate.upgrade(url)
    with engine.connect() as db:
        stored = db.execute(select(JobTag.job_id, JobTag.tag)).all()
    engine.dispose()
    assert {job_id: sorted(t for j, t in stored if j == job_id) for job_id in made} == made


def test_a_fine_tune_starts_from_another_jobs_weights_and_a_mismatch_names_the_parameter(stack, api):
    import torch

    train = {"max_steps": 20, "log_every": 5, "seed": 0, "checkpoint_every": 10}
    source = wait_terminal(api, api.post("/v1/jobs", json=mlp_spec(name="pretrain", train=train)).json()["id"])
    assert source["status"] == "succeeded", source["error"]
    still = {"optimizer": {"type": "sgd", "lr": 1e-12}, "train": {"max_steps": 2, "log_every": 1, "seed": 5}}
    tuned = {which: api.post("/v1/jobs", json=mlp_spec(name=f"tune-{which}", **still, init_from={
        "job": source["id"], "checkpoint": which})).json()["id"] for which in ("final", "latest")}
    wrong = api.post("/v1/jobs", json=mlp_spec(name="tune-wrong", model={"type": "mlp", "hidden": [32]},
                                               init_from={"job": source["id"]})).json()["id"]
    storage = stack.settings.resolved_storage_dir

    def weights(job_id: str) -> dict:
        return torch.load(storage / "jobs" / job_id / "artifacts" / "model.pt", weights_only=True)

    start = weights(source["id"])
    for which, job_id in tuned.items():
        job = wait_terminal(api, job_id)
        assert job["status"] == "succeeded", job["error"]
        assert "[trainjobs] initialised the model from" in api.get(f"/v1/jobs/{job_id}/logs").text
        # Two steps at lr 1e-12 change nothing: the fine-tune's weights are the source's (final = step 20 = latest)
        assert all(torch.allclose(weights(job_id)[k], v, atol=1e-9) for k, v in start.items()), which
    failed = wait_terminal(api, wrong)
    assert failed["status"] == "failed" and failed["error"]["type"] == "ValueError"
    assert "init_from: parameter" in failed["error"]["message"] and "[32, " in failed["error"]["message"]
    assert failed["attempt"] == 1  # a mismatch is not retried

    missing = api.post("/v1/jobs", json=mlp_spec(init_from={"job": "0123456789abcdef0123"}))
    assert missing.status_code == 404 and missing.json()["field"] == "init_from.job"
    no_model = api.post("/v1/jobs", json=mlp_spec(init_from={"job": failed["id"]}))
    assert no_model.status_code == 422 and "has no final model" in no_model.json()["detail"]


def test_an_entrypoint_is_handed_the_weights_path_in_its_environment():
    from pathlib import Path

    from trainjobs.spec import JobSpec
    from worker import launch

    spec = JobSpec.model_validate({"entrypoint": {"script": "t.py"}, "init_from": {"job": "0" * 20}})
    plan = launch.render(spec, job_id="1" * 20, attempt=1, run_dir=Path("/runs/x"), python="/py",
                         data_dir=Path("/data"), job_dir=Path("/storage/jobs/x"), shutdown_grace_s=5, base_env={},
                         cpu_count=2, entry_script=Path("/s/t.py"),
                         init_from=Path("/storage/jobs/0/artifacts/model.pt"))
    assert plan.env["TRAINJOBS_INIT_FROM"] == "/storage/jobs/0/artifacts/model.pt"
