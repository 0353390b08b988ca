"""The training runtime's parts, in process: datasets, models, schedule (one torch import for all)."""

import json
import math
import re

import pytest
import torch

from service.errors import InvalidRequest
from service.jobs import retries
from tests.conftest import mlp_spec
from tests.helpers import run_torchrun
from trainjobs.spec import JobSpec, OptimizerConfig
from worker.root_cause import root_cause
from worker.train.data import build_dataset
from worker.train.models import build_model, loss_fn
from worker.train.optim import lr_at

GPT = {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 8, "vocab_size": 256}


@pytest.mark.parametrize("data,task,shape", [
    ({"type": "synthetic_regression", "num_samples": 64, "input_dim": 5, "output_dim": 2}, "regression", (4, 2)),
    ({"type": "synthetic_classification", "num_samples": 64, "input_dim": 5, "num_classes": 3},
     "classification", (4, 3)),
])
def test_mlp_datasets_and_outputs(tmp_path, data, task, shape):
    spec = JobSpec.model_validate(mlp_spec(data=data))
    dataset, info = build_dataset(spec, tmp_path)
    assert len(dataset) == 64 and info.task == task
    x, y = dataset[:4]
    out = build_model(spec.model, info)(x)
    assert out.shape == shape
    assert loss_fn(info.task, out, y).ndim == 0


def test_text_dataset_is_byte_windows_of_the_file(tmp_path):
    (tmp_path / "corpus.txt").write_text("héllo wörld! " * 20)
    spec = JobSpec.model_validate(mlp_spec(model=GPT, data={"type": "text", "path": "corpus.txt"}))
    dataset, info = build_dataset(spec, tmp_path)
    raw = (tmp_path / "corpus.txt").read_bytes()
    assert len(dataset) == (len(raw) - 1) // 8 and info.tokens_per_sample == 8
    x, y = dataset[1]
    assert bytes(x.tolist()) == raw[8:16] and bytes(y.tolist()) == raw[9:17]
    logits = build_model(spec.model, info)(x[None])
    assert logits.shape == (1, 8, 256)


def test_text_dataset_refuses_paths_outside_the_data_dir(tmp_path):
    spec = JobSpec.model_validate(mlp_spec(model=GPT, data={"type": "text", "path": "../x.txt"}))
    with pytest.raises(InvalidRequest, match="outside the data directory"):
        build_dataset(spec, tmp_path)


def test_synthetic_lm_has_structure_to_learn(tmp_path):
    spec = JobSpec.model_validate(mlp_spec(model={**GPT, "vocab_size": 32},
                                           data={"type": "synthetic_lm", "num_samples": 200, "branching": 2}))
    dataset, _ = build_dataset(spec, tmp_path)
    x, y = dataset[0]
    assert x.shape == y.shape == (8,) and torch.equal(x[1:], y[:-1])
    # Each token has 2 likely successors: the best bigram guess is right far above chance (1/32).
    tokens = dataset.tokens
    pairs = torch.zeros(32, 32)
    pairs.index_put_((tokens[:-1], tokens[1:]), torch.ones(len(tokens) - 1), accumulate=True)
    assert (pairs.max(dim=1).values.sum() / pairs.sum()).item() > 0.4


def test_gpt_is_causal(tmp_path):
    torch.manual_seed(0)
    spec = JobSpec.model_validate(mlp_spec(model=GPT, data={"type": "synthetic_lm", "num_samples": 4}))
    model = build_model(spec.model, build_dataset(spec, tmp_path)[1])
    a = torch.randint(0, 256, (1, 8))
    b = a.clone()
    b[0, 5:] = (b[0, 5:] + 1) % 256
    assert torch.allclose(model(a)[0, :5], model(b)[0, :5], atol=1e-6)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    cfg = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=10)
    assert lr_at(cfg, 0, 100) == pytest.approx(0.1)
    assert lr_at(cfg, 9, 100) == pytest.approx(1.0)
    assert lr_at(cfg, 10, 100) == pytest.approx(1.0)
    assert lr_at(cfg, 100, 100) == pytest.approx(0.1)
    assert lr_at(OptimizerConfig(lr=0.5), 1000, 10) == 0.5
    assert all(math.isfinite(lr_at(cfg, s, 100)) for s in range(200))


def test_gradient_accumulation_skips_the_ddp_all_reduce_on_inner_micro_batches(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.train.main import gradient_sync

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(4, 1))
        calls = []

        def counting_hook(state, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, counting_hook)
        for micro in range(3):
            with gradient_sync(model, enabled=micro == 2):
                model(torch.randn(2, 4)).sum().backward()
            assert len(calls) == (1 if micro == 2 else 0)
    finally:
        dist.destroy_process_group()


def test_mfu_counts_6n_per_token_plus_attention_over_the_device_peak(monkeypatch):
    from worker.train.flops import PEAK_FLOPS_ENV, flops_per_sample, mfu, peak_flops

    spec = JobSpec.model_validate(mlp_spec(model=GPT, data={"type": "synthetic_lm"}))
    n, emb = 10_000, 2_000
    per_token = 6 * (n - emb) + 12 * GPT["n_layer"] * GPT["d_model"] * GPT["seq_len"]
    assert flops_per_sample(spec.model, n, emb) == per_token * GPT["seq_len"]
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA A10") == 125e12
    assert peak_flops("Some Future Chip") is None  # then no mfu rather than a made-up one
    monkeypatch.setenv(PEAK_FLOPS_ENV, "1e15")
    assert peak_flops("Some Future Chip") == 1e15
    assert mfu(samples_per_s=100, flops_sample=1e12, peak=1e15, world_size=2) == pytest.approx(0.05)


DIVERGING = {"optimizer": {"type": "sgd", "lr": 10, "momentum": 0.9}, "resources": {"nnodes": 1, "nproc_per_node": 1,
                                                                                   "device": "cpu"},
             "data": {"type": "synthetic_regression", "num_samples": 64, "batch_size": 16}}


def test_a_diverging_run_fails_naming_the_step_where_the_loss_became_nan_and_is_not_retried(tmp_path):
    spec = mlp_spec(train={"max_steps": 200, "log_every": 1}, **DIVERGING)
    records = run_torchrun(spec, tmp_path, check=False)
    error = root_cause(tmp_path, 1, excerpt="", entrypoint=False)
    assert error["type"] == "NonFiniteLoss", error
    named = re.fullmatch(r"loss is (NaN|\+inf|-inf) at step (\d+)", error["message"])  # this one: +inf at step 4
    assert named, error["message"]
    step = int(named[2])
    # The series shows where: every step before it has its loss, that step has its other points but no loss.
    logged = {r["step"]: r["metrics"] for r in records if r["type"] == "metrics"}
    assert sorted(logged) == list(range(1, step)) and not any(r["type"] == "summary" for r in records)
    assert not retries.is_retryable(error, [])


def test_with_stop_on_nan_off_a_diverging_run_goes_on_and_its_summary_stays_strict_json(tmp_path):
    spec = mlp_spec(train={"max_steps": 60, "log_every": 1, "stop_on_nan": False}, **DIVERGING)
    records = run_torchrun(spec, tmp_path)
    summary = next(r["summary"] for r in records if r["type"] == "summary")
    assert summary["steps"] == 60 and summary["final_loss"] is None
    first = summary["diverged_at_step"]
    assert 1 < first <= 60 and "loss" not in next(r["metrics"] for r in records if r.get("step") == first)
    json.dumps(summary, allow_nan=False)
