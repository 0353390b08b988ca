"""Each stage of an attempt's start (worker/attempt/), driven alone, without a stack: place → prepare → sandbox →
launch → what its end means."""

import os
import sys
from pathlib import Path

import pytest

from service.settings import Settings
from tests.conftest import mlp_spec
from trainjobs import paths
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType, JobStatus
from worker import sandbox
from worker.attempt import outcome, prepare, start
from worker.attempt.place import Placed
from worker.attempt.ship import progress, work_done
from worker.shipping import MetricCaps, MetricTail
from worker.watch import Watch

GPU_SHARE = {"devices": [2, 3], "kind": "cuda", "uuids": ["GPU-cccc", "GPU-dddd"], "visible": "GPU-cccc,GPU-dddd",
             "cores": [8, 9, 10, 11], "worker": "w1", "of": 8}
CPU_SPEC = JobSpec.model_validate(mlp_spec())
GPU_SPEC = JobSpec.model_validate(mlp_spec(resources={"nnodes": 1, "nproc_per_node": 2, "device": "cuda"}))


def test_placed_gives_its_gpus_by_uuid_its_cores_and_its_share_of_memory():
    placed = Placed.of(GPU_SHARE, GPU_SPEC)
    assert placed.env({"PATH": "/bin"}) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "GPU-cccc,GPU-dddd"}
    assert placed.cores == [8, 9, 10, 11]
    assert placed.memory_bytes(64 * 2**30) == 16 * 2**30  # 2 of the worker's 8 GPUs: a quarter
    whole = Placed.of(None, GPU_SPEC)  # a worker not shared: everything
    assert whole.cores == [] and whole.memory_bytes(64 * 2**30) == 64 * 2**30 and whole.env({}) == {}
    assert Placed.of({**GPU_SHARE, "kind": "cpu"}, CPU_SPEC).device_nodes() == ()  # a CPU job binds no GPU


def test_prepare_renders_torchrun_with_its_gpus_its_threads_and_none_of_the_workers_secrets(tmp_path):
    settings = Settings(data_dir=tmp_path)
    code = prepare.Code(scripts_dir=tmp_path)
    plan = prepare.render(GPU_SPEC, settings, job_id="j1", attempt=2, run_dir=tmp_path / "run",
                          job_dir=tmp_path / "job", python=sys.executable, code=code,
                          placed=Placed.of(GPU_SHARE, GPU_SPEC), gang=None,
                          environ={"PATH": "/usr/bin", "AWS_SECRET_ACCESS_KEY": "x", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "GPU-cccc,GPU-dddd"  # its own, not the worker's
    assert plan.env["OMP_NUM_THREADS"] == "2"  # 4 cores for 2 ranks
    assert "AWS_SECRET_ACCESS_KEY" not in plan.env and plan.env["TRAINJOBS_ATTEMPT"] == "2"
    assert plan.argv[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node" in plan.argv


def test_prepare_refuses_a_users_script_on_a_worker_that_runs_none_and_makes_the_jobs_folders(tmp_path):
    spec = JobSpec.model_validate({"entrypoint": {"script": "train.py"}, "resources": {"device": "cpu"}})
    with pytest.raises(prepare.REFUSALS) as refused:
        prepare.find_code(spec, Settings(data_dir=tmp_path, allow_entrypoints=False), tmp_path / "run")
    assert prepare.refusal(refused.value)["type"] == ErrorType.ENTRYPOINT_DISABLED
    assert prepare.find_code(CPU_SPEC, Settings(data_dir=tmp_path), tmp_path / "run").entry_script is None
    prepare.make_dirs(job_dir=tmp_path / "job", run_dir=tmp_path / "run", attempt=3)
    assert (tmp_path / "job" / "OWNER").read_text() == "3"
    assert all((tmp_path / "job" / f).is_dir() for f in (paths.CHECKPOINTS, paths.ARTIFACTS))


def box_for(settings: Settings, tmp_path: Path) -> sandbox.Box:
    prepare.make_dirs(job_dir=tmp_path / "job", run_dir=tmp_path / "run", attempt=1)  # the stage before
    return start.enclose(settings, job_id="j1", run_dir=tmp_path / "run", job_dir=tmp_path / "job",
                         python=sys.executable, code=prepare.Code(scripts_dir=tmp_path),
                         placed=Placed.of({**GPU_SHARE, "kind": "cpu", "uuids": []}, CPU_SPEC), gang=None)


def test_the_sandbox_stage_leaves_the_command_alone_where_the_sandbox_is_off(tmp_path):
    box = box_for(Settings(data_dir=tmp_path, sandbox="off"), tmp_path)
    try:
        argv, env = box.wrap(["torchrun", "x"], {"A": "1"})
        assert argv == ["torchrun", "x"] and env["A"] == "1" and env["HOME"] == str(tmp_path / "run" / "home")
    finally:
        box.close()


@pytest.mark.skipif(sandbox.detect(Settings()).bwrap is None, reason="no sandbox on this machine")
def test_the_sandbox_stage_wraps_torchrun_in_bwrap_with_a_pid_namespace_of_its_own(tmp_path):
    box = box_for(Settings(data_dir=tmp_path / "data"), tmp_path)
    try:
        argv, _ = box.wrap(["torchrun", "x"], {})
        assert Path(argv[0]).name == "bwrap" and "--unshare-pid" in argv and "--die-with-parent" in argv
        assert argv[-2:] == ["torchrun", "x"] and not any(a.startswith("/dev/nvidia") for a in argv)
    finally:
        box.close()


def test_the_launch_stage_pins_the_attempt_to_its_cores_and_finds_its_processes(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    box = box_for(Settings(data_dir=tmp_path, sandbox="off"), tmp_path)
    script = "print(open('/proc/self/status').read(), flush=True)"
    launched = start.launch_attempt([sys.executable, "-c", script], {"PATH": os.environ["PATH"]}, cwd=tmp_path,
                                    box=box, cores=[core], tag="stage-test.1")
    try:
        assert launched.proc.wait(timeout=30) == 0
        assert launched.pump.wait_closed(10, 0.1, lambda: None)
        status = launched.pump.take().decode()
        assert f"Cpus_allowed_list:\t{core}\n" in status
        assert launched.proc.pid == launched.procs.root_pid and launched.procs.find() == []
    finally:
        launched.procs.stop(0)
        launched.proc.stdout.close()
        box.close()


def test_an_attempt_stopped_for_its_time_or_a_bad_device_fails_saying_why_and_a_cancel_is_not_a_failure(tmp_path):
    settings = Settings(data_dir=tmp_path)
    spec = JobSpec.model_validate(mlp_spec(timeout_s=30))
    watch = Watch(spec=spec, settings=settings, job_id="j1", attempt=1,
                  metrics=MetricTail(tmp_path / "m.jsonl", MetricCaps.of(settings)))
    args = {"spec": spec, "settings": settings, "watch": watch, "node_rank": 0}
    timed_out = outcome.stopped("timeout", -15, [42], **args)
    assert timed_out.status == JobStatus.FAILED and "timeout_s=30" in timed_out.error["message"]
    assert timed_out.killed_pids == [42]
    bad = outcome.stopped("device_unhealthy", -15, [], **args, device_problem="GPU 3 (GPU-dddd) fell off the bus")
    assert bad.error["type"] == outcome.DEVICE_UNHEALTHY and "GPU-dddd" in bad.error["message"]
    assert outcome.stopped("cancelled", -15, [], **args) is None and outcome.stopped(None, 0, [], **args) is None
    watch.close()


def test_progress_and_the_last_step_are_read_from_what_the_ranks_reported(tmp_path):
    spec = JobSpec.model_validate(mlp_spec(train={"max_steps": 100}))
    metrics = MetricTail(tmp_path / "m.jsonl", MetricCaps.of(Settings(data_dir=tmp_path)))
    metrics.last_step, metrics.last_step_time_s = 49, 0.5
    assert progress(spec, metrics) == {"step": 49, "total_steps": 100, "eta_s": 25.5} and not work_done(spec, metrics)
    metrics.last_step = 99
    assert work_done(spec, metrics)
