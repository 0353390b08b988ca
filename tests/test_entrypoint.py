"""Entrypoint mode: a user's own module or script under torchrun, its gate, its path checks, its reporter."""

import json
import os
import shutil
from pathlib import Path

import pytest

import trainjobs as user_report
from service.db import make_engine, make_sessionmaker
from service.jobs import service as jobs
from service.metrics import service as metrics
from service.settings import Settings
from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_terminal
from trainjobs.spec import JobSpec
from worker import agent, launch
from worker.shipping import MetricTail

EXAMPLE_SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"


def entry_spec(**entrypoint) -> dict:
    return mlp_spec(model=None, data=None, entrypoint=entrypoint)


def render(spec: dict, **kw) -> launch.Launch:
    return launch.render(JobSpec.model_validate(spec), job_id="0123456789abcdef0123", attempt=1,
                         run_dir=Path("/runs/x"), python="/py", data_dir=Path("/data"),
                         job_dir=Path("/storage/jobs/x"), shutdown_grace_s=7,
                         base_env={"PATH": "/bin", "PYTHONPATH": "/site"}, cpu_count=8, **kw)


def test_module_entrypoint_runs_under_torchrun_with_its_args_and_the_scripts_dir_importable():
    plan = render(entry_spec(module="my_pkg.train", args=["--lr", "3e-4"]), scripts_dir=Path("/scripts"))
    assert plan.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert plan.argv[plan.argv.index("--nproc-per-node") + 1] == "2"
    assert plan.argv[-5:] == [str(launch.USER_MAIN), "module", "my_pkg.train", "--lr", "3e-4"]
    assert "worker.train" not in plan.argv
    assert plan.env["PYTHONPATH"] == "/scripts:/site"
    assert plan.env["TRAINJOBS_JOB_ID"] == "0123456789abcdef0123"
    assert plan.env["TRAINJOBS_CHECKPOINT_DIR"] == "/storage/jobs/x/checkpoints"
    assert plan.env["TRAINJOBS_METRICS_FILE"] == "/runs/x/metrics.jsonl"


def test_script_entrypoint_runs_the_resolved_path_and_needs_one():
    spec = entry_spec(script="train.py", args=["--steps", "5"])
    plan = render(spec, scripts_dir=Path("/scripts"), entry_script=Path("/scripts/train.py"))
    assert plan.argv[-5:] == [str(launch.USER_MAIN), "script", "/scripts/train.py", "--steps", "5"]
    with pytest.raises(ValueError, match="resolve_script"):
        render(spec)
    assert render(mlp_spec(), scripts_dir=Path("/scripts")).env["PYTHONPATH"] == "/site"  # built-in: untouched


@pytest.fixture
def scripts(tmp_path) -> Path:
    root = tmp_path / "scripts"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "train.py").write_text("print('hi')\n")
    (root / "inside.py").symlink_to(root / "sub" / "train.py")
    (tmp_path / "secret.py").write_text("print('outside')\n")
    (root / "outside.py").symlink_to(tmp_path / "secret.py")
    (root / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    return root


def test_script_resolves_to_its_real_path_inside_the_scripts_dir(scripts):
    assert launch.resolve_script(scripts, "sub/train.py") == scripts / "sub" / "train.py"
    assert launch.resolve_script(scripts, "inside.py") == scripts / "sub" / "train.py"  # a link that stays


@pytest.mark.parametrize(("script", "kind"), [
    ("../secret.py", "invalid_entrypoint"),
    ("sub/../../secret.py", "invalid_entrypoint"),
    ("/etc/passwd", "invalid_entrypoint"),
    ("outside.py", "invalid_entrypoint"),  # a symlink out of the dir
    ("linked_dir/secret.py", "invalid_entrypoint"),  # through a linked folder
    ("missing.py", "entrypoint_not_found"),
    ("sub", "entrypoint_not_found"),  # a folder is not a script
])
def test_script_outside_the_scripts_dir_or_missing_is_refused(scripts, script, kind):
    with pytest.raises(launch.EntrypointRefused) as refused:
        launch.resolve_script(scripts, script)
    assert refused.value.kind == kind and script in refused.value.message


@pytest.mark.parametrize("script", ["/abs/train.py", "../train.py", "a/../../train.py"])
def test_api_refuses_a_script_path_that_leaves_the_scripts_dir(client, script):
    r = client.post("/v1/jobs", json=entry_spec(script=script))
    assert r.status_code == 422
    assert "relative path inside the scripts directory" in json.dumps(r.json()["detail"])


def run_on_worker(monkeypatch, client, settings: Settings, spec: dict) -> dict:
    """Submit through the API, run the worker's job function in-process, return the job as the API shows it."""
    job = client.post("/v1/jobs", json=spec).json()
    monkeypatch.setattr(agent, "get_settings", lambda: settings)
    assert agent.run_job(job["id"])["status"] == "failed"
    return client.get(f"/v1/jobs/{job['id']}").json()


def test_worker_without_the_flag_fails_an_entrypoint_job_saying_how_to_enable_it(monkeypatch, client, settings):
    job = run_on_worker(monkeypatch, client, settings, entry_spec(module="my_pkg.train"))
    assert job["status"] == "failed" and job["finished_at"] is not None
    assert job["error"]["type"] == "entrypoint_disabled"
    assert "TRAINJOBS_ALLOW_ENTRYPOINTS=1" in job["error"]["message"]
    assert job["progress"] == {"step": 0, "total_steps": None, "eta_s": None}


def test_missing_script_fails_the_job_before_anything_runs(monkeypatch, client, settings, tmp_path):
    allowed = settings.model_copy(update={"allow_entrypoints": True, "scripts_dir": tmp_path / "scripts"})
    job = run_on_worker(monkeypatch, client, allowed, entry_spec(script="nope.py"))
    assert job["error"]["type"] == "entrypoint_not_found"
    assert "'nope.py'" in job["error"]["message"] and str(tmp_path / "scripts") in job["error"]["message"]


def test_report_writes_lines_the_supervisor_ships_only_on_local_rank_zero_and_the_summary_on_rank_zero(
        monkeypatch, settings, tmp_path):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("TRAINJOBS_METRICS_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    user_report.report(step=1, loss=9.0)
    assert not path.exists()
    monkeypatch.setenv("RANK", "2")  # local rank 0 of another node of a gang: its node's series, no summary
    monkeypatch.setenv("LOCAL_RANK", "0")
    user_report.summary(final_loss=7.0)
    assert not path.exists()
    monkeypatch.setenv("RANK", "0")
    user_report.report(step=5, total_steps=20, loss=0.5, acc=1)
    user_report.report(step=10, total_steps=20, loss=float("nan"), acc=2)  # a NaN is dropped, not shipped
    user_report.summary(final_loss=0.25, note="done")
    with path.open("a") as f:  # a script may write anything to the file: a bad line is skipped
        f.write('not json\n{"type": "metrics"}\n')

    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(entry_spec(module="x"))).id
        db.commit()
        tail = MetricTail(path)
        assert metrics.insert_shipped(db, job_id=job_id, attempt=1, points=tail.part()) == 3
        db.commit()
        tail.committed()
        series = {s["name"]: s for s in metrics.read_series(db, job_id=job_id)}
    engine.dispose()
    assert series["loss"] == {"name": "loss", "steps": [5], "values": [0.5]}
    assert series["acc"]["steps"] == [5, 10]
    assert tail.summary == {"final_loss": 0.25, "note": "done"}
    assert (tail.last_step, tail.total_steps) == (10, 20) and tail.last_step_time_s >= 0


def test_report_is_a_no_op_outside_the_service(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINJOBS_METRICS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    user_report.report(step=1, total_steps=3, loss=1.0)
    user_report.summary(final_loss=1.0)
    assert user_report.checkpoint_dir() is None and user_report.artifacts_dir() is None
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="step"):
        user_report.report(step="one", loss=1.0)


@pytest.fixture(scope="module")
def entry_stack(postgres_url, tmp_path_factory):
    scripts = tmp_path_factory.mktemp("scripts")
    for script in EXAMPLE_SCRIPTS.glob("*.py"):
        shutil.copy(script, scripts / script.name)
    (scripts / "print_env.py").write_text(
        "import os\n"
        "print('token', os.environ.get('TRAINJOBS_TEST_API_TOKEN'))\n"
        "print('db', os.environ.get('TRAINJOBS_DATABASE_URL'), 'redis', os.environ.get('TRAINJOBS_REDIS_URL'))\n"
        "print('mine', os.environ.get('MY_SETTING'))\n")
    (scripts / "grab_admin.py").write_text(GRAB_ADMIN)
    os.environ["TRAINJOBS_TEST_API_TOKEN"] = LEAKY  # in the workers' environment, as a cloud key would be
    try:
        with live_stack(postgres_url, tmp_path_factory.mktemp("entry"), name="entry", allow_entrypoints=True,
                        scripts_dir=scripts) as s:
            yield s
    finally:
        del os.environ["TRAINJOBS_TEST_API_TOKEN"]


LEAKY = "sk-live-0123456789abcdef"
# The attack: look for the admin token in the folders a job is given, then swap the artifacts folder
# for a link to wherever it is (the data dir where it used to be, else the secrets dir beside it) and ask the
# artifacts route for it.
GRAB_ADMIN = """import os, shutil
from pathlib import Path
data = Path(os.environ["TRAINJOBS_DATA_DIR"])
for folder in (data, Path(os.environ["TRAINJOBS_CHECKPOINT_DIR"]).parent):
    for path in folder.rglob("admin.token"):
        print("found", path)
target = data if (data / "admin.token").exists() else data.with_name(data.name + "-secrets")
artifacts = Path(os.environ["TRAINJOBS_ARTIFACTS_DIR"])
try:
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.symlink_to(target)
    print("linked", artifacts.is_symlink())
except OSError as exc:  # in the sandbox the folder is a mount point: it stays
    print("could not link:", exc)
"""


def test_a_script_that_prints_the_workers_secrets_leaks_none_into_the_logs(entry_stack):
    with entry_stack.client(timeout=10) as api:
        spec = entry_spec(script="print_env.py") | {"env": {"MY_SETTING": "from the spec"}}
        spec["resources"]["nproc_per_node"] = 1
        job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"])
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
    assert job["status"] == "succeeded", (job["error"], logs)
    assert "mine from the spec" in logs  # the job's own env (JobSpec.env)
    assert "token None" in logs and LEAKY not in logs  # the worker's own variables are not the job's (an allow-list)
    assert "db None redis None" in logs  # ranks never get the service's connection strings


def test_a_script_finds_no_admin_token_and_cannot_have_it_served_through_a_link(entry_stack):
    with entry_stack.client(timeout=10) as api:
        spec = entry_spec(script="grab_admin.py")
        spec["resources"]["nproc_per_node"] = 1
        job = wait_terminal(api, api.post("/v1/jobs", json=spec).json()["id"])
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
        listed = api.get(f"/v1/jobs/{job['id']}/artifacts").json()
        served = api.get(f"/v1/jobs/{job['id']}/artifacts/admin.token")
    assert job["status"] == "succeeded", job["error"]
    assert ("linked True" in logs or "could not link" in logs) and "found" not in logs
    assert listed == {"items": [], "data": [], "count": 0}
    assert served.status_code == 404 and entry_stack.token not in served.text


def test_plain_and_reported_torchrun_scripts_run_to_success_through_the_service(entry_stack):
    with entry_stack.client(timeout=10) as api:
        plain = api.post("/v1/jobs", json=entry_spec(script="plain_ddp.py", args=["--steps", "30"])).json()
        reported = api.post("/v1/jobs", json=entry_spec(module="reported_ddp", args=["--steps", "30"])).json()
        plain, reported = wait_terminal(api, plain["id"]), wait_terminal(api, reported["id"])

        logs = api.get(f"/v1/jobs/{plain['id']}/logs").text
        assert plain["status"] == "succeeded", (plain["error"], logs[-3000:])  # the script's own words, if it failed
        assert plain["summary"] is None and plain["progress"]["total_steps"] is None
        assert "step 10/30 loss" in logs and "step 30/30 loss" in logs and "plain_ddp: done" in logs

        assert reported["status"] == "succeeded", (reported["error"],
                                                   api.get(f"/v1/jobs/{reported['id']}/logs").text[-3000:])
        assert reported["progress"]["step"] == 30 and reported["progress"]["total_steps"] == 30
        assert reported["summary"]["steps"] == 30 and reported["summary"]["world_size"] == 2
        series = {s["name"]: s for s in api.get(f"/v1/jobs/{reported['id']}/metrics").json()["series"]}
        assert series["loss"]["steps"] == list(range(5, 31, 5))
        assert series["loss"]["values"][-1] < series["loss"]["values"][0]
        assert series["loss"]["values"][-1] == pytest.approx(reported["summary"]["final_loss"])
        assert "step 30/30 loss" in api.get(f"/v1/jobs/{reported['id']}/logs").text
        artifacts = api.get(f"/v1/jobs/{reported['id']}/artifacts").json()["data"]
        assert [a["name"] for a in artifacts] == ["model.pt"]


def test_entrypoint_that_cannot_start_fails_with_its_exception_up_front(entry_stack):
    """The rank's exception (type, message, the frames) is the job's error, as the built-in runtime's is, not only
    torchrun's exit code: worker/user_main.py writes it where torchrun's @record would."""
    with entry_stack.client(timeout=10) as api:
        job = wait_terminal(api, api.post("/v1/jobs", json=entry_spec(module="no_such_pkg.train")).json()["id"])
    error = job["error"]
    assert job["status"] == "failed" and job["attempt"] == 1  # ImportError: the code is wrong, not retried
    assert error["type"] == "ImportError" and error["exit_code"] == 1 and error["rank"] in (0, 1), error
    assert "'no_such_pkg.train' (ModuleNotFoundError" in error["message"]
    assert error["traceback"].startswith("Traceback") and "ImportError" in error["traceback"]
    assert "'no_such_pkg.train' (ModuleNotFoundError" in error["excerpt"]
