"""Unmodified Hugging Face Trainer, Lightning, TensorBoard (and tensorboardX) and MLflow scripts, run as real jobs
through a worker, report their series (names and steps as the framework logs them), progress, ETA and summary
(trainjobs/capture), once per step under 2-rank DDP; bad input is bounded; a retried attempt and a handed-back one
resume from the framework's own checkpoint with their steps kept."""

import shutil
import signal
import subprocess
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.cli.tables import job_row
from tests.helpers import live_stack, wait_for, wait_terminal
from trainjobs.states import TERMINAL

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboardX")

EXAMPLE_SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"

# MLflow's calls, tensorboardX's, then bad input through TensorBoard: NaN, a 10 kB name, 20,000 distinct tags (past
# capture's 10,000 and the worker's 1,000 names), a step of -1.
BAD_INPUT = """
import math
import mlflow
from tensorboardX import SummaryWriter as XWriter
from torch.utils.tensorboard import SummaryWriter

with mlflow.start_run():
    mlflow.log_params({"lr": 0.1, "optimizer": "sgd"})
    for step in range(1, 4):
        mlflow.log_metrics({"mlflow_acc": step / 10, "mlflow_inf": math.inf}, step=step)
xwriter = XWriter("tbx")
for step in range(1, 4):
    xwriter.add_scalar("tbx_loss", 1.0 / step, step)
xwriter.close()
writer = SummaryWriter("tb")
for step in range(1, 4):
    writer.add_scalar("loss", 1.0 / step, step)
writer.add_scalar("nan_loss", math.nan, 3)
writer.add_scalar("x" * 10_000, 1.0, 3)
for i in range(20_000):
    writer.add_scalar(f"tag{i}", 1.0, 3)
writer.add_scalar("loss", 1.0, -1)
writer.close()
print("bad_input: done", flush=True)
"""

# Runs an example as it is, but its first attempt dies after step CRASH_AT on every rank (as a lost node ends it):
# the retried attempt should resume from the framework's own checkpoint (step 20) in TRAINJOBS_CHECKPOINT_DIR.
CRASH_ONCE = """
import os
import runpy
import sys

CRASH_AT = 22
if os.environ["TRAINJOBS_ATTEMPT"] == "1":
    if sys.argv[1] == "hf_trainer.py":
        from transformers import Trainer, TrainerCallback

        class Crash(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == CRASH_AT:
                    os._exit(3)

        init = Trainer.__init__
        Trainer.__init__ = lambda self, *a, **k: (init(self, *a, **k), self.add_callback(Crash()))[0]
    else:
        import lightning as L

        class Crash(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == CRASH_AT:
                    os._exit(3)

        init = L.Trainer.__init__
        L.Trainer.__init__ = lambda self, *a, callbacks=(), **k: init(self, *a, callbacks=[*callbacks, Crash()], **k)
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), script), run_name="__main__")
"""


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    scripts = tmp_path_factory.mktemp("scripts")
    for script in ("hf_trainer.py", "lightning_module.py", "tensorboard_loop.py"):
        shutil.copy(EXAMPLE_SCRIPTS / script, scripts / script)
    (scripts / "bad_input.py").write_text(textwrap.dedent(BAD_INPUT))
    (scripts / "crash_once.py").write_text(textwrap.dedent(CRASH_ONCE))
    with live_stack(postgres_url, tmp_path_factory.mktemp("frameworks"), name="frameworks", allow_entrypoints=True,
                    scripts_dir=scripts, cancel_grace_s=10, reconcile_s=1, sweep_s=0.5) as s:
        yield s


def spec(script: str, *args: str, nproc: int = 2, env: dict | None = None) -> dict:
    return {"name": script.removesuffix(".py"), "strategy": "ddp",
            "resources": {"nnodes": 1, "nproc_per_node": nproc, "device": "cpu"},
            "entrypoint": {"script": script, "args": list(args)}, "env": env or {}, "timeout_s": 300}


def run(api, job_spec: dict, *, live: list | None = None) -> tuple[dict, dict[str, dict], str]:
    """The job run to its end; `live` gets each progress seen while it ran (a terminal job shows no ETA)."""
    job_id = api.post("/v1/jobs", json=job_spec).json()["id"]

    def done() -> dict | None:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if job["status"] == "running" and live is not None:
            live.append(job["progress"])
        return job if job["status"] in TERMINAL else None

    job = wait_for(done, 240, interval=0.1, what=f"job {job_id} to end")
    logs = api.get(f"/v1/jobs/{job['id']}/logs").text
    assert job["status"] == "succeeded", (job["error"], logs[-3000:])
    series = {s["name"]: s for s in api.get(f"/v1/jobs/{job['id']}/metrics").json()["series"]}
    return job, series, logs


def test_an_unmodified_hf_trainer_under_2_rank_ddp_reports_its_series_once_per_step(stack):
    with stack.client(timeout=10) as api:
        job, series, logs = run(api, spec("hf_trainer.py", "--steps", "20", "--log-every", "5"))
    assert "hf_trainer: done, 20 steps" in logs
    assert series["loss"]["steps"] == [5, 10, 15, 20]  # once per step: rank 0's alone
    assert series["loss"]["values"][-1] < series["loss"]["values"][0]
    assert series["learning_rate"]["steps"] == series["grad_norm"]["steps"] == [5, 10, 15, 20]
    assert series["eval_loss"]["steps"] == [10, 20]
    assert series["epoch"]["steps"] == [5, 10, 15, 20]  # logged with the eval too: stored once
    assert series["train_runtime"]["steps"] == [20]
    assert job["progress"]["step"] == 20 and job["progress"]["total_steps"] == 20
    summary = job["summary"]
    assert summary["global_step"] == 20 and summary["train_loss"] > 0 and summary["train_samples_per_second"] > 0
    assert summary["eval_loss"] == pytest.approx(series["eval_loss"]["values"][-1])
    # The ETA while it runs, from max_steps: 20 steps can end between two ships (CI saw only step 0 live), so a
    # longer run, as for Lightning below.
    with stack.client(timeout=10) as api:
        run(api, spec("hf_trainer.py", "--steps", "600", "--log-every", "100", "--save-every", "600"),
            live=(live := []))
    assert any(p["total_steps"] == 600 and p["step"] < 600 and (p["eta_s"] or 0) > 0 for p in live), live


def test_an_unmodified_lightning_module_under_2_rank_ddp_reports_what_its_logger_gets(stack):
    with stack.client(timeout=10) as api:
        job, series, logs = run(api, spec("lightning_module.py", "--steps", "40", "--log-every", "5"))
    assert "lightning_module: done, 40 steps" in logs
    # Lightning's logger steps (_batches_that_stepped, before the batch counts): what TensorBoardLogger shows.
    assert series["train_loss"]["steps"] == list(range(4, 40, 5))
    assert series["val_loss"]["steps"] == [19, 39]
    assert series["train_loss"]["values"][-1] < series["train_loss"]["values"][0]
    # The last step counted: its logger's last step is 39 (the batch index), the progress a user sees is 40/40.
    assert job["progress"]["total_steps"] == 40 and job_row(job, datetime.now(UTC))["STEP"] == "40/40"
    assert job["summary"]["global_step"] == 40 and job["summary"]["train_steps_per_second"] > 0
    assert job["summary"]["val_loss"] == pytest.approx(series["val_loss"]["values"][-1], rel=1e-5)
    # The ETA while it runs, from estimated_stepping_batches: 40 steps can end between two ships, so a longer run.
    with stack.client(timeout=10) as api:
        run(api, spec("lightning_module.py", "--steps", "2000", "--log-every", "100"), live=(live := []))
    assert any(p["total_steps"] == 2000 and p["step"] < 1999 and (p["eta_s"] or 0) > 0 for p in live), live


def test_an_unmodified_summarywriter_loop_reports_its_scalars_at_their_global_step(stack):
    with stack.client(timeout=10) as api:
        job, series, logs = run(api, spec("tensorboard_loop.py", "--steps", "20", "--log-every", "5"))
        names = [a["name"] for a in api.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]]
    assert "tensorboard_loop: done" in logs
    for name in ("loss", "lr", "weights/min", "weights/max"):
        assert series[name]["steps"] == [5, 10, 15, 20], name
    assert job["summary"]["loss"] == pytest.approx(series["loss"]["values"][-1]) and job["summary"]["step"] == 20
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in names)  # its own files, as before


def test_bad_input_is_bounded_with_one_line_each_and_mlflow_calls_succeed_without_a_server(stack):
    with stack.client(timeout=10) as api:
        job, series, logs = run(api, spec("bad_input.py", nproc=1))
    assert "bad_input: done" in logs  # MLflow logged to its file store in the checkpoint dir, no server
    assert series["loss"]["steps"] == series["mlflow_acc"]["steps"] == series["tbx_loss"]["steps"] == [1, 2, 3]
    assert "nan_loss" not in series and "mlflow_inf" not in series
    assert not any(len(name) > 64 for name in series)
    assert len([n for n in series if not n.startswith("cpu_util/")]) <= 1000  # the worker's cap on the job's names
    for line in ("non-finite values (NaN, inf)", "points under names longer than 64 characters",
                 "points under names past the first 10,000", "points at steps outside 0..2147483647"):
        assert logs.count(f"[trainjobs] capture: {line} are not stored (the first: ") == 1, line
    assert "[trainjobs] capture: not stored, in all: " in logs
    assert "under names past the job's 1000 (TRAINJOBS_METRIC_MAX_NAMES" in logs  # the worker's own note
    assert job["summary"]["params"] == {"lr": "0.1", "optimizer": "sgd"}
    assert job["summary"]["mlflow_acc"] == pytest.approx(0.3)


@pytest.mark.parametrize(("script", "args", "series_name", "logged"), [
    ("hf_trainer.py", ["--steps", "40", "--log-every", "5", "--save-every", "10"], "loss", list(range(5, 41, 5))),
    ("lightning_module.py", ["--steps", "40", "--log-every", "5"], "train_loss", list(range(4, 40, 5))),
])
def test_a_retried_attempt_resumes_from_the_framework_s_own_checkpoint_with_its_steps(stack, script, args,
                                                                                     series_name, logged):
    job_spec = {**spec("crash_once.py", script, *args), "max_retries": 1}
    with stack.client(timeout=10) as api:
        job, series, logs = run(api, job_spec)
        attempts = api.get(f"/v1/jobs/{job['id']}/attempts").json()["data"]
    assert job["attempt"] == 2 and [a["status"] for a in attempts] == ["failed", "succeeded"], attempts
    assert attempts[1]["resumed_from_step"] == 20  # the checkpoint saved at step 20, before the crash at 22
    assert "[trainjobs] capture: resuming from " in logs
    assert series[series_name]["steps"] == logged  # attempt 1's points kept, none trained (or logged) twice
    assert job["progress"]["step"] == job["progress"]["total_steps"] == job["summary"]["global_step"] == 40


def live_worker(stack) -> subprocess.Popen:
    alive = [p for name, p in stack.procs if name.startswith("worker") and p.poll() is None]
    if not alive:
        stack.add_workers(1)
        alive = [stack.procs[-1][1]]
    return alive[0]


def test_a_handed_back_hf_trainer_saves_and_the_next_attempt_resumes_with_its_steps(stack):
    worker = live_worker(stack)
    with stack.client(timeout=10) as api:
        job_id = api.post("/v1/jobs", json=spec("hf_trainer.py", "--steps", "400", "--log-every", "20",
                                                "--save-every", "100000")).json()["id"]
        wait_for(lambda: (api.get(f"/v1/jobs/{job_id}").json()["progress"] or {}).get("step", 0) >= 40, 120,
                 interval=0.1, what="training to pass step 40")
        worker.send_signal(signal.SIGTERM)  # the worker shuts down: the job is handed back
        assert worker.wait(timeout=60) == 0
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "queued" and job["attempt"] == 1, job
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
        step = int(logs.split(": saving a checkpoint at step ")[1].split()[0])  # after "SIGTERM" or "preempted"
        assert 40 <= step < 400

        live_worker(stack)
        job = wait_terminal(api, job_id, timeout=240)
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
        assert job["status"] == "succeeded" and job["attempt"] == 2, (job["error"], logs[-3000:])
        assert "resuming from " in logs and f"checkpoint-{step}" in logs
        attempts = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
        assert [(a["status"], a["resumed_from_step"]) for a in attempts] == [("preempted", None), ("succeeded", step)]
        loss = api.get(f"/v1/jobs/{job_id}/metrics").json()["series"]
    steps = next(s for s in loss if s["name"] == "loss")["steps"]
    assert steps == list(range(20, 401, 20))  # the steps before the hand-back kept, none twice
    assert job["summary"]["global_step"] == 400
