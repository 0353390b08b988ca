"""The first hour (issue 36): what a new user sees is true and says what is going on."""

from sqlalchemy import update

from service.db import make_engine, make_sessionmaker
from service.jobs.models import Job
from tests.conftest import mlp_spec
from tests.test_pending import add_worker


def test_a_job_that_ended_shows_no_eta(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:  # as a supervisor left it: its last progress, then the job failed
        conn.execute(update(Job).where(Job.id == job_id).values(
            status="failed", progress={"step": 5, "total_steps": 20, "eta_s": 12.5}))
    engine.dispose()
    progress = client.get(f"/v1/jobs/{job_id}").json()["progress"]
    assert progress == {"step": 5, "total_steps": 20, "eta_s": None}


def test_the_follow_bar_says_why_a_queued_job_waits():
    from service.cli.follow import ProgressView
    from trainjobs.client import Event

    view = ProgressView({"status": "queued", "progress": {"step": 0, "total_steps": 20},
                         "pending_reason": "no live worker fits (needs 8 processes per node; the largest has 2)"})
    assert view.fields()["status"] == "queued: no live worker fits (needs 8 processes per node; the largest has 2)"
    view.apply(Event(kind="status", data={"status": "running", "pending_reason": None}, id="1"))
    assert view.fields()["status"] == "running"


def test_a_typo_in_a_field_says_did_you_mean_and_a_body_that_is_not_json_is_a_400(client):
    spec = mlp_spec(resources={"nproc_per_nod": 2, "device": "cpu"})
    answer = client.post("/v1/jobs", json=spec)
    assert answer.status_code == 422
    [error] = answer.json()["detail"]
    assert error["loc"] == ["body", "resources", "nproc_per_nod"] and error["did_you_mean"] == "nproc_per_node"
    assert error["msg"] == "Extra inputs are not permitted: did you mean 'nproc_per_node'?"
    sweep = {"name": "s", "spec": mlp_spec(optimiser={"lr": 0.1}), "parameters": {"optimizer.lr": {"values": [1]}}}
    [error] = client.post("/v1/sweeps", json=sweep).json()["detail"]
    assert error["did_you_mean"] == "optimizer", error
    answer = client.post("/v1/jobs", content=b'{"name": "x",', headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["field"] == "body", answer.text
    assert answer.json()["detail"].startswith("the body is not valid JSON at character")


def test_a_job_no_live_worker_could_run_is_refused_naming_what_none_has_unless_it_will_wait(client, settings):
    assert client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 8})).status_code == 201  # no worker yet
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        add_worker(db, "w1", labels={"zone": "a"})  # 1 CPU slot, runs no users' code
        db.commit()
    engine.dispose()
    eight = client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 8, "device": "cpu"}))
    assert eight.status_code == 422 and eight.json()["field"] == "resources.nproc_per_node"
    assert eight.json()["detail"].startswith("needs 8 processes per node; the largest live worker (w1) offers 1")
    cuda = client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 1, "device": "cuda"}))
    assert cuda.status_code == 422 and cuda.json()["field"] == "resources.device"
    assert "no live worker has device cuda: the pool has 1 cpu worker(s)" in cuda.json()["detail"]
    zoned = client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 1, "selector": {"zone": "b"}}))
    assert zoned.status_code == 422 and zoned.json()["field"] == "resources.selector"
    own = client.post("/v1/jobs", json=mlp_spec(model=None, data=None, entrypoint={"script": "train.py"},
                                                 resources={"nproc_per_node": 1}))
    assert own.status_code == 403 and own.json()["field"] == "entrypoint"
    assert "TRAINJOBS_ALLOW_ENTRYPOINTS=1" in own.json()["detail"]
    waits = client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 8}),
                        params={"allow_unschedulable": "true"})
    assert waits.status_code == 201 and waits.json()["status"] == "queued"
    fits = client.post("/v1/jobs", json=mlp_spec(resources={"nproc_per_node": 1}))
    assert fits.status_code == 201
    # A gang of more nodes than workers that fit: one node per worker, so it could never start on this pool.
    pair = client.post("/v1/jobs", json=mlp_spec(resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"}))
    assert pair.status_code == 422 and pair.json()["field"] == "resources.nnodes", pair.text
    assert pair.json()["detail"].startswith("needs 2 nodes; 1 live worker(s) fit one (w1)")
