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


def test_queue_entries_of_jobs_this_database_never_had_say_another_stack_shares_the_redis(client, settings, redis,
                                                                                        caplog):
    from service.jobs import queue

    mine = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    assert client.get("/readyz").json()["warnings"] == []
    foreign = "0" * 12 + "deadbeef"  # a job of another stack, on the same Redis db and queue prefix
    queue.enqueue(redis, prefix=settings.queue_prefix, job_id=foreign, priority="normal", timeout_s=60)
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db, caplog.at_level("WARNING", logger="service.jobs.queue"):
        queue.reconcile(db, redis, prefix=settings.queue_prefix, min_age_s=10.0)  # the sweeper's full pass
    engine.dispose()
    said = f"1 queue entry (e.g. {foreign}) name no job in this database: another trainjobs stack"
    assert any(said in r.getMessage() for r in caplog.records), caplog.text
    ready = client.get("/readyz")
    assert ready.status_code == 200 and said in ready.json()["warnings"][0], ready.text
    assert "TRAINJOBS_QUEUE_PREFIX" in ready.json()["warnings"][0]
    assert mine in queue.get_queue(redis, settings.queue_prefix, "normal").get_job_ids()  # its own entry stays


def test_the_plan_of_a_tiny_model_is_in_kib_or_mib_not_zero_gib(client, capsys, tmp_path):
    import json

    from service.cli import main as cli
    from service.cli.tables import format_bytes
    from trainjobs.client import Client

    assert [format_bytes(n) for n in (512, 3 * 2**10, 5.5 * 2**20, 40 * 2**30)] == [
        "512 B", "3.000 KiB", "5.500 MiB", "40.000 GiB"]
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(mlp_spec()))
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app, with the admin token
    assert cli.main(["plan", str(spec)], client=api) == 0
    out = capsys.readouterr().out
    assert "0.000 GiB" not in out and ("KiB" in out or "MiB" in out), out


# A user's own 2-rank script: rank 0 prints its lines; with --fail, rank 1 makes the usual mistake.
OWN_SCRIPT = """import sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    for i in range(5):
        print(f"own line {i}", flush=True)
dist.barrier()
if "--fail" in sys.argv and rank == 1:
    config = {"lr": 0.1}
    print(config["learning_rate"])
dist.destroy_process_group()
"""


def test_run_follow_streams_the_scripts_lines_and_status_shows_its_exception(postgres_url, tmp_path):
    import re

    from tests.helpers import live_stack, stack_cli

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(OWN_SCRIPT)
    with live_stack(postgres_url, tmp_path / "data", name="firsthour", allow_entrypoints=True) as stack:
        trainjobs = stack_cli(stack, cwd=project, config=tmp_path / "config.toml")

        ok = trainjobs("run", "--nproc-per-node", "2", "--follow", "--", "train.py")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        at = [ok.stdout.find(f"own line {i}") for i in range(5)]
        assert -1 not in at and at == sorted(at) and at[-1] < ok.stdout.find("succeeded"), ok.stdout
        job_id = re.search(r"submitted ([0-9a-f]{20})", ok.stdout)[1]
        with stack.client() as api:
            log = api.get(f"/v1/jobs/{job_id}/logs").text
        assert "own line 4" in log and "Warning" not in log, log  # nothing the service caused (reduce_op ...)
        # nor c10d's "hostname of the client socket cannot be retrieved", a sandbox without DNS's (bare torchrun: none)
        assert "cannot be retrieved" not in log, log

        failed = trainjobs("run", "--nproc-per-node", "2", "--follow", "--quiet", "--", "train.py", "--fail")
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "own line" not in failed.stdout  # --quiet: the bar alone
        assert "KeyError on rank 1: 'learning_rate'" in failed.stdout, failed.stdout
        job_id = re.search(r"submitted ([0-9a-f]{20})", failed.stdout)[1]
        status = trainjobs("status", job_id[:12])
    assert status.returncode == 0, status.stdout + status.stderr
    assert "KeyError on rank 1: 'learning_rate'" in status.stdout
    assert 'print(config["learning_rate"])' in status.stdout and "ChildFailedError" not in status.stdout


TIME_FIELDS = ("modified", "time", "last_seen", "estimated_start", "fill_by", "deadline")


def test_every_time_the_api_describes_is_an_iso_8601_string(client):
    """Every field of a response schema that holds a time (`*_at`, `modified`, ...) is a date-time string."""
    def kinds(prop: dict) -> list:
        if "anyOf" in prop:
            return [k for p in prop["anyOf"] for k in kinds(p)]
        return [] if prop.get("type") == "null" else [(prop.get("type"), prop.get("format"))]

    found = {f"{name}.{field}": kinds(prop)
             for name, schema in client.get("/openapi.json").json()["components"]["schemas"].items()
             for field, prop in (schema.get("properties") or {}).items()
             if field.endswith(("_at", "_time")) or field in TIME_FIELDS}
    assert len(found) > 20 and "ArtifactPublic.modified" in found, sorted(found)
    assert {k: v for k, v in found.items() if v != [("string", "date-time")]} == {}
