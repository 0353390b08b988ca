"""The torchrun command is a pure function of the spec."""

from pathlib import Path

from service.jobs.spec import JobSpec
from tests.conftest import mlp_spec
from worker import launch


def render(spec: dict, **kw):
    return launch.render(JobSpec.model_validate(spec), job_id="0123456789abcdef0123", attempt=2,
                         run_dir=Path("/runs/x"), python="/py", data_dir=Path("/data"),
                         job_dir=Path("/storage/jobs/x"), shutdown_grace_s=7,
                         base_env={"PATH": "/bin"}, cpu_count=8, **kw)


def test_single_node_launch_is_standalone_without_restarts():
    plan = render(mlp_spec())
    assert plan.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    args = plan.argv[3:]
    assert "--standalone" in args
    assert args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("--max-restarts") + 1] == "0"
    assert args[-3:] == ["-m", "worker.train", "/runs/x"]


def test_launch_env_tags_every_process_and_keeps_temp_files_in_the_run_dir():
    env = render(mlp_spec()).env
    assert env[launch.RUN_TAG_ENV] == "0123456789abcdef0123.2"
    assert env["TMPDIR"] == "/runs/x/tmp"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7"
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores over 2 ranks
    assert env["PATH"] == "/bin"
