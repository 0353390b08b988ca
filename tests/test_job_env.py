"""A job's own environment variables (JobSpec.env): set for every rank, bounded, never the service's names."""

from pathlib import Path

import pytest

from tests.conftest import mlp_spec
from tests.helpers import count_jobs
from trainjobs.spec import ENV_MAX_BYTES, JobSpec
from worker import launch


def render(spec: dict) -> launch.Launch:
    return launch.render(JobSpec.model_validate(spec), job_id="0123456789abcdef0123", attempt=1,
                         run_dir=Path("/runs/x"), python="/py", data_dir=Path("/data"),
                         job_dir=Path("/storage/jobs/x"), shutdown_grace_s=7,
                         base_env={"PATH": "/bin", "MY_FLAG": "worker's"}, cpu_count=8)


def test_the_jobs_env_reaches_the_ranks_over_the_workers_own_and_under_the_services():
    env = render(mlp_spec(env={"MY_FLAG": "job's", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})).env
    assert env["MY_FLAG"] == "job's" and env["WANDB_MODE"] == "offline"
    assert env["OMP_NUM_THREADS"] == "1"  # a tuning knob the user may set; the worker's default otherwise
    assert env["TRAINJOBS_JOB_ID"] == "0123456789abcdef0123" and env["PATH"] == "/bin"
    assert render(mlp_spec()).env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("name", ["LD_PRELOAD", "ld_library_path", "TRAINJOBS_DATABASE_URL", "PYTHONPATH", "PATH",
                                  "CUDA_VISIBLE_DEVICES", "MASTER_PORT", "RANK", "TORCHELASTIC_RUN_ID", "TMPDIR"])
def test_a_reserved_name_is_a_422_naming_the_variable_and_no_job(client, settings, name):
    response = client.post("/v1/jobs", json=mlp_spec(env={"OK": "1", name: "x"}))
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"][-1] == "env" and repr(name) in error["msg"]
    assert count_jobs(settings.database_url) == 0


@pytest.mark.parametrize(("env", "says"), [
    ({"1BAD": "x"}, "pattern"),
    ({"HAS SPACE": "x"}, "pattern"),
    ({"BIG": "x" * 4097}, "4096"),
    ({f"V{i}": "x" for i in range(65)}, "64"),
    ({f"V{i}": "x" * 4000 for i in range(9)}, str(ENV_MAX_BYTES)),
    ({"NUL": "a\0b"}, "NUL"),
    ({"NUM": 3}, "string"),
])
def test_an_env_out_of_bounds_is_a_422_that_says_why(client, settings, env, says):
    response = client.post("/v1/jobs", json=mlp_spec(env=env))
    assert response.status_code == 422, response.text
    assert says in response.text and "env" in str(response.json()["detail"][0]["loc"])
    assert count_jobs(settings.database_url) == 0
