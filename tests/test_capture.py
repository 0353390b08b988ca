"""trainjobs/capture without a worker: the sink's bounds, the import hook's laziness and cost, the off switch, a
failing hook, and the frameworks' stop on the supervisor's PREEMPT_SIGNAL with a resume from the saved checkpoint
(torchrun running worker/user_main.py as the worker starts it, outside the sandbox)."""

import json
import os
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
    sink.scalars(1, {"loss": 1.0, "epoch": 0, "nan": float("nan"), "inf": float("-inf"), "x" * 10_000: 1.0,
                     "text": "high"})
    sink.scalars(-1, {"loss": 2.0})
    sink.scalars("2", {"loss": 2.0})
    for i in range(MAX_NAMES + 5_000):
        sink.scalar(f"tag{i}", 1.0, 3)
    sink.scalars(4, {"loss": 0.5, "epoch": 1})
    sink.scalars(4, {"epoch": 1})  # the same name again at the same step: stored once
    sink.at_exit()
    err = capsys.readouterr().err
    for kind in ("non-finite values (NaN, inf)", "points under names longer than 64 characters",
                 "values that are not numbers", "points at steps outside 0..2147483647",
                 f"points under names past the first {MAX_NAMES:,}"):
        assert err.count(f"[trainjobs] capture: {kind} are not stored (the first: ") == 1, kind
    assert "[trainjobs] capture: not stored, in all: " in err and "non-finite values (NaN, inf): 2;" in err
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


def preempt_once_past(proc: subprocess.Popen, metrics: Path, step: int) -> tuple[str, list[dict]]:
    """PREEMPT_SIGNAL to the ranks (as the supervisor sends it) once training passed `step`; their output."""
    wait_for(lambda: any(r["type"] == "metrics" and r["step"] >= step for r in records(metrics)), 120,
             what=f"training to pass step {step}")
    assert processes.signal_ranks(proc.pid, PREEMPT_SIGNAL) == 2
    out, _ = proc.communicate(timeout=60)
    return out, records(metrics)


@pytest.mark.parametrize(("script", "first", "then", "checkpoint"), [
    ("hf_trainer.py", ["--steps", "3000", "--log-every", "10", "--save-every", "100000"],
     ["--steps", "{end}", "--log-every", "10", "--save-every", "100000"], "checkpoint-{step}"),
    ("lightning_module.py", ["--steps", "3000", "--log-every", "10"], ["--steps", "{end}", "--log-every", "10"],
     "last.ckpt"),
])
def test_preempted_ranks_save_at_one_step_and_the_next_attempt_resumes_there(tmp_path, script, first, then,
                                                                            checkpoint):
    proc, metrics = start_ranks(tmp_path, script, *first)
    out, written = preempt_once_past(proc, metrics, 20)
    assert proc.returncode == 0, out[-3000:]
    preempted = [r["step"] for r in written if r["type"] == "preempted"]
    assert len(preempted) == 1, out[-3000:]
    step = preempted[0]
    assert out.count("[trainjobs] capture: preempted: sav") == 1  # rank 0's line alone
    assert not any(r["type"] == "summary" for r in written)  # not done: the job goes back to the queue
    assert (tmp_path / "checkpoints" / checkpoint.format(step=step)).exists()

    end = step + 30
    started = time.monotonic()
    proc, metrics = start_ranks(tmp_path, script, *(a.format(end=end) for a in then))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    written = records(metrics)
    assert [r["step"] for r in written if r["type"] == "resumed"] == [step], out[-3000:]
    steps = [r["step"] for r in written if r["type"] == "metrics" and r["metrics"]]
    assert steps and min(steps) > step - 10  # no step before the checkpoint is trained again
    assert written[-1]["type"] == "summary" and time.monotonic() - started < 120
