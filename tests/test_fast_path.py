"""The runtime's fast path (issue 34): torch.compile changes speed, never the numbers; FLOPs, MFU and throughput.

Compiled runs use the aot_eager backend (dynamo and AOTAutograd trace the blocks, the same graphs inductor gets, but
no C++ is generated): inductor on this 2-core CI box takes ~2 minutes for one 2-rank job. One MLP case runs
inductor itself. Gradient accumulation of k micro-batches against one batch k times larger is pinned in
tests/test_ddp_equivalence.py.
"""

import json
import math

import pytest
import torch

from tests.conftest import mlp_spec
from tests.helpers import run_torchrun
from trainjobs.spec import JobSpec

GPT = {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8, "vocab_size": 32}
MODELS = {
    "gpt": (GPT, {"type": "synthetic_lm", "num_samples": 256, "batch_size": 8}),
    "mlp": ({"type": "mlp", "hidden": [32, 32]}, {"type": "synthetic_regression", "num_samples": 1024,
                                                   "batch_size": 64}),
}


def spec(model: str, strategy: str = "ddp", *, compile: bool = False, backend: str = "aot_eager",
         steps: int = 8, nproc: int = 2, fsdp: dict | None = None, **train) -> dict:
    cfg, data = MODELS[model]
    data = {**data, "batch_size": data["batch_size"] * 2 // nproc}  # the same global batch on 1 or 2 ranks
    return mlp_spec(strategy=strategy, model=cfg, data=data, resources={"nproc_per_node": nproc},
                    optimizer={"type": "adamw", "lr": 1e-2}, fsdp=fsdp or {},
                    train={"max_steps": steps, "log_every": 1, "seed": 5, "compile": compile,
                           "compile_backend": backend, **train})


def losses(records: list[dict]) -> list[float]:
    return [r["metrics"]["loss"] for r in records if r["type"] == "metrics"]


def summary_of(records: list[dict]) -> dict:
    return next(r["summary"] for r in records if r["type"] == "summary")


@pytest.fixture(scope="module")
def eager_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each model's records under DDP without compile: the reference (FSDP matches DDP: test_ddp_equivalence)."""
    root = tmp_path_factory.mktemp("eager")
    return {name: run_torchrun(spec(name), root / name) for name in MODELS}


@pytest.fixture(scope="module")
def eager(eager_runs) -> dict[str, list[float]]:
    return {name: losses(records) for name, records in eager_runs.items()}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_on_gives_the_losses_of_compile_off(tmp_path, eager, model, strategy):
    # The GPT's FSDP blocks are also checkpoint-wrapped: compile traces the recompute too.
    fsdp = {"activation_checkpointing": True} if (model, strategy) == ("gpt", "fsdp") else None
    records = run_torchrun(spec(model, strategy, compile=True, fsdp=fsdp), tmp_path)
    assert summary_of(records)["compiled"] is True
    assert eager[model][-1] < eager[model][0]  # it learns, so the match is not trivial
    assert losses(records) == pytest.approx(eager[model], abs=1e-5, rel=0)


def test_inductor_compiles_the_mlp_to_the_same_losses(tmp_path, eager):
    """One rank (the same global batch): each rank compiles for itself, and 2 cores make 2 compiles slow."""
    records = run_torchrun(spec("mlp", compile=True, backend="inductor", nproc=1), tmp_path)
    assert summary_of(records)["compiled"] is True
    assert losses(records) == pytest.approx(eager["mlp"], abs=1e-5, rel=0)


def test_a_checkpoint_written_without_compile_resumes_with_it_and_the_other_way_round(tmp_path, eager):
    """FSDP (sharded checkpoints) off → on → off, 3 steps at a time: the losses of one uninterrupted eager run.

    Module.compile keeps the parameters' names, so either kind of run reads the other's checkpoint.
    """
    job_dir, got = tmp_path / "job", []
    for leg, (compile, until) in enumerate([(False, 3), (True, 6), (False, 8)]):
        records = run_torchrun(spec("gpt", "fsdp", compile=compile, steps=until, checkpoint_every=3),
                               tmp_path / f"leg{leg}", job_dir=job_dir)
        got += losses(records)
        assert summary_of(records)["resumed_from_step"] == (None, 3, 6)[leg]
    assert got == pytest.approx(eager["gpt"], abs=1e-5, rel=0)


def test_the_summary_s_throughput_comes_from_the_measured_step_time(eager_runs):
    records = eager_runs["gpt"]
    s = summary_of(records)
    assert s["samples_per_s"] == pytest.approx(s["steps"] * s["global_batch"] / s["wall_time_s"])
    assert s["step_time_s"] == pytest.approx(s["wall_time_s"] / s["steps"])
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * GPT["seq_len"])
    assert s["precision"] == "fp32" and "mfu" not in s and "peak_flops" not in s  # a CPU: no peak, no MFU
    assert "gpu_util" not in s and "gpu_mem_peak_mb" not in s  # no NVML figures on CPU, never made-up ones
    for r in (r for r in records if r["type"] == "metrics"):
        m = r["metrics"]
        assert m["samples_per_s"] == pytest.approx(s["global_batch"] / m["step_time_s"])


def hand_count(n_layer: int, d: int, t: int, vocab: int) -> tuple[int, int]:
    """Training FLOPs of one sequence, counted by hand, (the weights' matmuls, the attention's): each matmul's
    2·m·n·k forward, twice that backward."""
    per_token_forward = n_layer * (2 * d * 3 * d + 2 * d * d + 2 * d * 4 * d * 2)  # qkv, proj, the MLP's two
    per_token_forward += 2 * d * vocab  # the head
    attention_forward = n_layer * 2 * (2 * t * t * d)  # QK^T and AV over the full square, per sequence
    return 3 * per_token_forward * t, 3 * attention_forward


def test_the_gpt_flops_match_a_hand_count_and_torch_s_flop_counter(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from worker.train.data import build_dataset
    from worker.train.flops import flops_per_sample
    from worker.train.models import build_model, loss_fn

    cfg = {"type": "gpt", "n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 32, "vocab_size": 128}
    job = JobSpec.model_validate(mlp_spec(model=cfg, data={"type": "synthetic_lm", "num_samples": 4}))
    model = build_model(job.model, build_dataset(job, tmp_path)[1])
    n = sum(p.numel() for p in model.parameters())
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    formula = flops_per_sample(job.model, n, emb)
    matmuls, attention = hand_count(2, 64, 32, 128)
    # The formula also counts 6 per bias and LayerNorm weight: 1-2% over the matmuls at this width.
    assert matmuls + attention <= formula <= 1.02 * (matmuls + attention)
    idx = torch.randint(0, 128, (1, 32))
    with FlopCounterMode(display=False) as counter:
        loss_fn("lm", model(idx), idx).backward()
    # torch counts the same matmuls (its counter has no formula for the CPU's fused attention kernel).
    assert counter.get_total_flops() == matmuls


def test_mfu_is_the_measured_flops_over_the_named_device_s_peak_and_absent_for_an_unknown_one(monkeypatch):
    from trainjobs.peaks import PEAK_FLOPS_ENV, peak_flops
    from worker.train.perf import Speed

    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494e12
    assert peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12  # not one for the other
    assert peak_flops("NVIDIA GH200 480GB") == 989e12 and peak_flops("NVIDIA A10G") == 70e12
    assert peak_flops("Tesla V100-SXM2-16GB") is None  # no bf16 units: no bf16 peak
    speed = Speed(global_batch=8, tokens_per_sample=1024, world_size=2, sample_flops=1e12,
                  device_name="NVIDIA H200", precision="bf16")
    figures = speed.figures(steps=10, seconds=4.0)
    assert figures["samples_per_s"] == 20 and figures["step_time_s"] == 0.4 and figures["tokens_per_s"] == 20 * 1024
    assert figures["mfu"] == pytest.approx(20 * 1e12 / (2 * 989e12))
    unknown = Speed(global_batch=8, tokens_per_sample=0, world_size=1, sample_flops=1e12,
                    device_name="Some Future Chip", precision="bf16")
    assert "mfu" not in unknown.figures(steps=1, seconds=1.0) and "peak_flops" not in unknown.constants()


def test_a_script_s_flops_per_step_gives_its_step_time_and_mfu(tmp_path, monkeypatch):
    import trainjobs.reporting as reporting

    metrics_file = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("TRAINJOBS_METRICS_FILE", str(metrics_file))
    monkeypatch.setenv("TRAINJOBS_PEAK_FLOPS", "1e12")  # the worker's declared peak, per device
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(reporting, "_speed", reporting._Speed())
    monkeypatch.setattr(reporting, "_open", None)  # a reporter of its own, dropped afterwards
    clock = iter([100.0, 100.5, 101.5])
    monkeypatch.setattr(reporting.time, "perf_counter", lambda: next(clock))
    reporting.report(0, flops_per_step=4e11, loss=2.0)
    reporting.report(1, flops_per_step=4e11, loss=1.5)  # 0.5 s for 1 step: 8e11 FLOP/s over 2 x 1e12
    reporting.report(3, flops_per_step=4e11, loss=1.0)  # 1.0 s for 2 steps
    reporting.summary(final_loss=1.0)
    with pytest.raises(ValueError, match="flops_per_step"):
        reporting.report(4, flops_per_step=math.inf)
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = {r["step"]: r["metrics"] for r in records if r["type"] == "metrics"}
    assert "mfu" not in steps[0] and "step_time_s" not in steps[0]  # nothing measured before the first call
    assert steps[1]["step_time_s"] == 0.5 and steps[1]["mfu"] == pytest.approx(0.4)
    assert steps[3]["step_time_s"] == 0.5 and steps[3]["mfu"] == pytest.approx(0.4)
    s = next(r["summary"] for r in records if r["type"] == "summary")
    assert s["final_loss"] == 1.0 and s["step_time_s"] == 0.5 and s["mfu"] == pytest.approx(0.4)
    assert s["flops_per_step"] == 4e11 and s["peak_flops"] == 1e12
    reporting._reporter().close()


def test_the_job_s_performance_shows_the_summary_s_figures_and_skips_a_script_s_bad_values():
    from service.jobs.schemas import performance_of

    perf = performance_of({"final_loss": 1.0, "tokens_per_s": 5e4, "mfu": 0.41, "device_name": "NVIDIA H200",
                           "gpu_util": "busy", "step_time_s": math.nan, "compiled": True})
    assert perf.tokens_per_s == 5e4 and perf.mfu == 0.41 and perf.device_name == "NVIDIA H200"
    assert perf.gpu_util is None and perf.step_time_s is None and perf.compiled is True
    assert performance_of({"final_loss": 1.0}) is None and performance_of(None) is None


def test_the_device_check_plans_its_rows_and_prints_one_table_without_a_gpu():
    """bench/gpu.py runs only where a GPU is lent: its planning and its table are checked here."""
    import subprocess
    import sys

    from bench import gpu

    out = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--gpus", "8", "--gpu-memory-gb", "80"],
                         capture_output=True, text=True, check=True, timeout=120).stdout.splitlines()
    assert out[1] == gpu.header()
    labels = [line.split("  ")[0].strip() for line in out[2:]]
    assert labels == ["fsdp compiled x1", "ddp compiled x1", "fsdp eager x1", "ddp eager x1", "fsdp compiled x8",
                      "ddp compiled x8"]
    assert all(line.endswith("planned (dry run)") and int(line.split()[3]) >= 1 and int(line.split()[4]) > 0
               for line in out[2:])  # a batch the plan fits, and its estimate
    job = {"status": "succeeded", "summary": {"final_loss": 3.2}, "memory": {"measured_peak_mb": 30_000.0},
           "performance": {"tokens_per_s": 250_000.0, "mfu": 0.452, "gpu_util": 97.0, "gpu_mem_peak_mb": 34_000.0}}
    row = gpu.line(gpu.Row("fsdp", True, 1), 16, 40_000.0, job)
    assert "30000" in row and "34000" in row and "0.75" in row and "45.2%" in row and row.endswith("ok")
    unknown = gpu.line(gpu.Row("ddp", False, 1), 8, 1.0, {**job, "performance": {"tokens_per_s": 10.0}})
    assert " n/a " in unknown  # an unknown device: no MFU


def test_the_runtime_speed_bench_runs_its_runtime_row_tiny():
    """bench/runtime_speed.py's A/B of the built-in GPT against the plain loop, one round of 4 steps."""
    import re
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "bench/runtime_speed.py", "--row", "runtime", "--rounds", "1", "--steps",
                           "4", "--log-every", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"built-in [\d.]+ ms/step, plain loop [\d.]+ ms/step, plain / built-in [\d.]+", done.stdout)
