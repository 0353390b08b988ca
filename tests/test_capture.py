"""trainjobs/capture without a worker: the sink's bounds (a million tags, 10 kB names, NaN, huge values), the import
hook's laziness and cost, the off switch, a failing hook, tensorboardX, a Trainer's own TensorBoard/MLflow reporting
not doubled, and the frameworks' stop on PREEMPT_SIGNAL or SIGTERM with a resume from the saved checkpoint (torchrun
running worker/user_main.py as the worker starts it, outside the sandbox)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainjobs import reporting
from trainjobs.capture.sink import MAX_NAMES, Sink
from trainjobs.runenv import PREEMPT_SIGNAL
from worker import launch, processes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_SCRIPTS = ROOT / "examples" / "scripts"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def metrics_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("TRAINJOBS_METRICS_FILE", str(path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(reporting, "_open", None)
    yield path
    if reporting._open is not None:
        reporting._open[1].close()


def test_the_sink_bounds_untrusted_input_with_one_line_each_and_keeps_the_rest(metrics_file, capsys):
    sink = Sink(rank0=True)
    # A NaN, an inf, a name of 10 kB, values that are no scalar (text, 10 MB of it, a million-element list).
    sink.scalars(1, {"loss": 1.0, "epoch": 0, "nan": float("nan"), "inf": float("-inf"), "x" * 10_000: 1.0,
                     "text": "high", "huge_text": "9" * 10_000_000, "huge_list": [1.0] * 1_000_000})
    sink.scalars(-1, {"loss": 2.0})
    sink.scalars("2", {"loss": 2.0})
    started = time.monotonic()
    for i in range(1_000_000):  # a million distinct tags
        sink.scalar(f"tag{i}", 1.0, 3)
    assert time.monotonic() - started < 60  # ~4 us a point on a loaded 2-core machine
    sink.scalars(4, {"loss": 0.5, "epoch": 1})
    sink.scalars(4, {"epoch": 1})  # the same name again at the same step: stored once
    sink.at_exit()
    err = capsys.readouterr().err
    for kind in ("non-finite values (NaN, inf)", "points under names longer than 64 characters",
                 "values that are not numbers", "points at steps outside 0..2147483647",
                 f"points under names past the first {MAX_NAMES:,}"):
        assert err.count(f"[trainjobs] capture: {kind} are not stored (the first: ") == 1, kind
    assert "[trainjobs] capture: not stored, in all: " in err and "non-finite values (NaN, inf): 2;" in err
    assert f"points under names past the first {MAX_NAMES:,}: {1_000_000 - MAX_NAMES + 4:,}" in err
    assert "values that are not numbers: 3" in err
    assert metrics_file.stat().st_size < 2_000_000  # what reached the job's metrics file is bounded too
    written = records(metrics_file)
    points = [(r["step"], name) for r in written if r["type"] == "metrics" for name in r["metrics"]]
    assert len(points) == len(set(points))
    assert [s for s, n in points if n == "loss"] == [1, 4] and [s for s, n in points if n == "epoch"] == [1, 4]
    assert len(sink.names) == MAX_NAMES  # its memory is bounded too
    assert len({n for _, n in points}) == MAX_NAMES - 2  # (nan and inf count as names, but store no point)
    summary = written[-1]
    assert summary["type"] == "summary" and summary["summary"]["loss"] == 0.5 and len(summary["summary"]) < 210


def test_only_global_rank_0_reports(metrics_file):
    sink = Sink(rank0=False)
    sink.scalars(1, {"loss": 1.0})
    sink.total_steps(10)
    sink.summary({"done": True})
    assert records(metrics_file) == []


def test_the_last_step_is_written_even_within_a_beat_of_the_previous_one(metrics_file):
    sink = Sink(rank0=True)
    sink.scalars(58, {"loss": 1.0})  # a framework's last log, at the batch index
    sink.beat(59)
    sink.beat(60)  # within BEAT_S of the previous beat: held back
    sink.reached(60)  # the run's end: global_step
    sink.reached(60)
    sink.summary({"global_step": 60})
    written = records(metrics_file)
    assert [r["step"] for r in written if r["type"] == "metrics"] == [58, 59, 60]
    assert written[-1]["summary"]["step"] == written[-1]["summary"]["global_step"] == 60


def test_a_hook_that_raises_turns_its_source_off_with_one_line(metrics_file, capsys):
    sink = Sink(rank0=True)

    def broken(*args):
        raise KeyError("boom")

    assert sink.guard("tensorboard", broken, 1) is None and sink.guard("tensorboard", broken, 2) is None
    sink.guard("mlflow", sink.scalar, "acc", 0.5, 1)  # another source goes on
    err = capsys.readouterr().err
    assert err.count("[trainjobs] capture: tensorboard capture turned off after an error inside it (KeyError") == 1
    assert [r["metrics"] for r in records(metrics_file)] == [{"acc": 0.5}]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_the_import_hook_loads_no_framework_and_costs_well_under_a_microsecond_per_import():
    code = (
        "import sys, time\n"
        "from trainjobs.capture import install, CaptureFinder\n"
        "install()\n"
        "finder = next(f for f in sys.meta_path if isinstance(f, CaptureFinder))\n"
        "assert sys.meta_path[0] is finder\n"
        "start = time.perf_counter()\n"
        "for i in range(100_000):\n"
        "    finder.find_spec('numpy.core.something', None)\n"
        "per = (time.perf_counter() - start) / 100_000\n"
        "import json, email.mime.text\n"
        "print(per, sorted({'torch', 'transformers', 'lightning', 'mlflow', 'tensorboard'} & set(sys.modules)))\n")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    per, loaded = out.stdout.split(maxsplit=1)
    assert float(per) < 1e-6 and loaded.strip() == "[]"


TB_SCRIPT = """
import trainjobs.capture.sink
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter({logdir!r})
writer.add_scalar("loss", 1.0, 1)
{break_it}
writer.add_scalar("loss", 0.5, 2)
writer.close()
print("script: done", flush=True)
"""


def run_user_main(tmp_path: Path, script: str, *, env: dict | None = None) -> tuple[subprocess.CompletedProcess,
                                                                                       list[dict]]:
    (tmp_path / "script.py").write_text(script)
    metrics = tmp_path / "metrics.jsonl"
    run_env = {**os.environ, "TRAINJOBS_METRICS_FILE": str(metrics), "RANK": "0", "LOCAL_RANK": "0", **(env or {})}
    done = subprocess.run([sys.executable, str(launch.USER_MAIN), "script", str(tmp_path / "script.py")],
                          capture_output=True, text=True, timeout=120, env=run_env)
    return done, records(metrics)


def test_capture_off_leaves_the_script_as_it_was(tmp_path):
    done, written = run_user_main(tmp_path, TB_SCRIPT.format(logdir=str(tmp_path / "tb"), break_it=""),
                                  env={"TRAINJOBS_CAPTURE": "0"})
    assert done.returncode == 0 and "script: done" in done.stdout, done.stderr
    assert written == [] and "[trainjobs] capture" not in done.stderr


def test_an_error_inside_capture_never_fails_the_script(tmp_path):
    # Capture's writing breaks (as a full disk would make it): the script's own TensorBoard goes on.
    break_it = "trainjobs.capture.sink.Sink.write = lambda self, step, points: 1 / 0"
    done, written = run_user_main(tmp_path, TB_SCRIPT.format(logdir=str(tmp_path / "tb"), break_it=break_it))
    assert done.returncode == 0 and "script: done" in done.stdout, done.stderr
    assert done.stderr.count("[trainjobs] capture: tensorboard capture turned off after an error inside it "
                             "(ZeroDivisionError") == 1
    assert [r["metrics"] for r in written if r["type"] == "metrics"] == [{"loss": 1.0}]
    assert any(p.name.startswith("events.out.tfevents") and p.stat().st_size > 100 for p in (tmp_path / "tb").iterdir())


TBX_SCRIPT = """
from tensorboardX import SummaryWriter
writer = SummaryWriter({logdir!r})
for step in (1, 2):
    writer.add_scalar("loss", 1.0 / step, step)
writer.add_scalars("lr", {{"head": 0.1, "body": 0.01}}, 2)
writer.close()
"""


def test_tensorboardx_scalars_are_captured_as_torch_s_summarywriter_s_are(tmp_path):
    pytest.importorskip("tensorboardX")
    done, written = run_user_main(tmp_path, TBX_SCRIPT.format(logdir=str(tmp_path / "tbx")))
    assert done.returncode == 0, done.stderr
    points = [(r["step"], r["metrics"]) for r in written if r["type"] == "metrics"]
    assert points == [(1, {"loss": 1.0}), (2, {"loss": 0.5}), (2, {"lr/head": 0.1}), (2, {"lr/body": 0.01})]
    assert written[-1]["type"] == "summary" and written[-1]["summary"]["lr/body"] == 0.01
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tbx").iterdir())


def start_ranks(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """torchrun over worker/user_main.py with 2 ranks, PREEMPT_SIGNAL ignored until a rank handles it (as the worker
    starts it); the checkpoint dir is shared across calls, the metrics file is this attempt's."""
    attempt = len(list(tmp_path.glob("attempt-*"))) + 1
    run_dir = tmp_path / f"attempt-{attempt}"
    (run_dir / "tmp").mkdir(parents=True)
    env = {**os.environ, "TRAINJOBS_METRICS_FILE": str(run_dir / "metrics.jsonl"), "TMPDIR": str(run_dir / "tmp"),
           "TRAINJOBS_CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "OMP_NUM_THREADS": "1",
           "TRAINJOBS_ARTIFACTS_DIR": str(run_dir)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            "--max-restarts", "0", str(launch.USER_MAIN), "script", str(EXAMPLE_SCRIPTS / script), *args]
    proc = subprocess.Popen(argv, env=env, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=processes.prepare_torchrun)
    return proc, run_dir / "metrics.jsonl"


def stop_once_past(proc: subprocess.Popen, metrics: Path, step: int, sig: int) -> tuple[str, list[dict]]:
    """Once training passed `step`: PREEMPT_SIGNAL to the ranks (as the supervisor sends it), or SIGTERM to torchrun
    (a cancel, a hand-back: torchrun forwards it to the ranks and waits for them); their output."""
    wait_for(lambda: any(r["type"] == "metrics" and r["step"] >= step for r in records(metrics)), 120,
             what=f"training to pass step {step}")
    if sig == PREEMPT_SIGNAL:
        assert processes.signal_ranks(proc.pid, PREEMPT_SIGNAL) == 2
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    return out, records(metrics)


HF_RUN = ["--steps", "{end}", "--log-every", "10", "--save-every", "100000"]
LIGHTNING_RUN = ["--steps", "{end}", "--log-every", "10"]


@pytest.mark.parametrize(("script", "args", "checkpoint", "sig"), [
    ("hf_trainer.py", HF_RUN, "checkpoint-{step}", PREEMPT_SIGNAL),
    ("lightning_module.py", LIGHTNING_RUN, "last.ckpt", PREEMPT_SIGNAL),
    ("hf_trainer.py", HF_RUN, "checkpoint-{step}", signal.SIGTERM),
    ("lightning_module.py", LIGHTNING_RUN, "last.ckpt", signal.SIGTERM),
], ids=["hf-preempt", "lightning-preempt", "hf-sigterm", "lightning-sigterm"])
def test_stopped_ranks_save_at_one_step_and_the_next_attempt_resumes_there(tmp_path, script, args, checkpoint, sig):
    proc, metrics = start_ranks(tmp_path, script, *(a.format(end=3000) for a in args))
    out, written = stop_once_past(proc, metrics, 20, sig)
    why = "preempted" if sig == PREEMPT_SIGNAL else "SIGTERM"
    assert out.count(f"[trainjobs] capture: {why}: sav") == 1, out[-3000:]  # rank 0's line alone
    step = int(out.split(f"[trainjobs] capture: {why}: sav")[1].split(" at step ")[1].split()[0].rstrip(";"))
    if sig == PREEMPT_SIGNAL:  # the job goes back to the queue, no retry spent: the ranks exit 0, `preempted`
        assert proc.returncode == 0, out[-3000:]
        assert [r["step"] for r in written if r["type"] == "preempted"] == [step]
    else:
        assert not any(r["type"] == "preempted" for r in written)
    assert not any(r["type"] == "summary" for r in written)  # not done
    assert (tmp_path / "checkpoints" / checkpoint.format(step=step)).exists()

    end = step + 30
    started = time.monotonic()
    proc, metrics = start_ranks(tmp_path, script, *(a.format(end=end) for a in args))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    written = records(metrics)
    assert [r["step"] for r in written if r["type"] == "resumed"] == [step], out[-3000:]
    steps = [r["step"] for r in written if r["type"] == "metrics" and r["metrics"]]
    assert steps and min(steps) > step - 10  # no step before the checkpoint is trained again
    assert written[-1]["type"] == "summary" and time.monotonic() - started < 120


@pytest.mark.parametrize("report_to", ["tensorboard", "mlflow"])
def test_a_trainer_reporting_to_tensorboard_or_mlflow_itself_gives_each_series_once(tmp_path, report_to):
    proc, metrics = start_ranks(tmp_path, "hf_trainer.py", "--steps", "10", "--log-every", "5", "--report-to",
                                report_to)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    points = [(r["step"], name) for r in records(metrics) if r["type"] == "metrics" for name in r["metrics"]]
    assert len(points) == len(set(points))  # no point twice
    assert [s for s, n in points if n == "loss"] == [5, 10]
    assert not [n for _, n in points if n.startswith(("train/", "eval/"))]  # not its integration's copies too
