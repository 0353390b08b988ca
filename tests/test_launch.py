"""The torchrun command is a pure function of the spec."""

from pathlib import Path

from tests.conftest import mlp_spec
from trainjobs import runenv
from trainjobs.spec import JobSpec
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
    assert env[runenv.RUN_TAG_ENV] == "0123456789abcdef0123.2"
    assert env["TMPDIR"] == "/runs/x/tmp"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7"
    assert env["OMP_NUM_THREADS"] == "4"  # 8 cores over 2 ranks
    assert env["PATH"] == "/bin"


def test_a_gang_node_launches_with_c10d_rendezvous_hosted_by_node_0():
    spec = mlp_spec(resources={"nnodes": 3, "nproc_per_node": 2, "device": "cpu"})
    for rank in (0, 2):
        gang = launch.Gang(nnodes=3, node_rank=rank, endpoint="10.0.0.1:29400", local_addr=f"10.0.0.{rank + 1}",
                           join_timeout_s=45)
        args = render(spec, gang=gang).argv[3:]
        assert "--standalone" not in args
        flags = dict(zip(args[:-3:2], args[1:-3:2], strict=True))
        assert flags["--nnodes"] == "3" and flags["--node-rank"] == str(rank) and flags["--nproc-per-node"] == "2"
        assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "10.0.0.1:29400"
        assert flags["--rdzv-id"] == "0123456789abcdef0123-2"  # one rendezvous per attempt
        assert flags["--rdzv-conf"] == f"is_host={int(rank == 0)},join_timeout=45"
        assert flags["--local-addr"] == f"10.0.0.{rank + 1}"  # the address the other nodes reach
        tag = render(spec, gang=gang).env[runenv.RUN_TAG_ENV]  # per node: stopping one never finds the other's
        assert tag == ("0123456789abcdef0123.2" if rank == 0 else f"0123456789abcdef0123.2.{rank}")
