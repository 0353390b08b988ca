"""Checkpoints: an interrupted run resumes from its newest complete checkpoint onto the same trajectory."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.conftest import mlp_spec
from tests.helpers import run_torchrun
from trainjobs.runenv import ATTEMPT_ENV
from trainjobs.spec import JobSpec
from worker.train.checkpoint import COMPLETE, OWNER, VettedLoadPlanner, complete_checkpoints, save_model
from worker.train.data import build_dataset
from worker.train.distributed import Dist
from worker.train.models import build_model

GPT = {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8, "vocab_size": 32}


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["metrics"]["loss"] for r in records if r["type"] == "metrics"}


def summary(records: list[dict]) -> dict:
    return next(r["summary"] for r in records if r["type"] == "summary")


@pytest.mark.parametrize("strategy,extra", [
    ("ddp", {"model": {"type": "mlp", "hidden": [16, 16]},
             "data": {"type": "synthetic_regression", "num_samples": 256, "batch_size": 16}}),
    ("fsdp", {"model": GPT, "data": {"type": "synthetic_lm", "num_samples": 256, "batch_size": 8},
              "optimizer": {"lr": 0.01, "schedule": "cosine", "warmup_steps": 3}}),
], ids=["ddp-mlp", "fsdp-gpt"])
def test_a_run_interrupted_after_a_checkpoint_resumes_onto_the_same_losses(tmp_path, strategy, extra):
    # 256 samples over 2 ranks of 16 (or 8) is 8 (16) batches an epoch: step 10 is mid-epoch 2.
    train = {"max_steps": 16, "log_every": 1, "seed": 5, "checkpoint_every": 4, "keep_checkpoints": 2}
    spec = mlp_spec(strategy=strategy, train=train, **extra)
    whole = run_torchrun(spec, tmp_path / "whole")

    storage = tmp_path / "job"
    faulty = {**spec, "fault_injection": {"raise_at_step": 10, "rank": 1, "message": "preempted"}}
    first = run_torchrun(faulty, tmp_path / "attempt-1", attempt=1, job_dir=storage, check=False)
    assert max(losses(first)) == 10 and not any(r["type"] == "summary" for r in first)
    assert [p.name for p in complete_checkpoints(storage / "checkpoints")] == ["step_00000004", "step_00000008"]
    # A save that died half-way is newer, but is never loaded.
    shutil.copytree(storage / "checkpoints" / "step_00000008", storage / "checkpoints" / "step_00000009")
    (storage / "checkpoints" / "step_00000009" / COMPLETE).unlink()

    second = run_torchrun(faulty, tmp_path / "attempt-2", attempt=2, job_dir=storage)  # the fault was attempt 1's
    assert summary(second)["resumed_from_step"] == 8
    resumed = losses(second)
    assert sorted(resumed) == list(range(9, 17))
    assert [resumed[s] for s in resumed] == pytest.approx([losses(whole)[s] for s in resumed], abs=1e-5, rel=0)
    assert losses(first)[8] == pytest.approx(losses(whole)[8], abs=1e-6)
    # keep_checkpoints: the two newest complete ones stay; the unfinished one is pruned.
    assert sorted(p.name for p in (storage / "checkpoints").iterdir()) == ["step_00000012", "step_00000016"]


def test_the_final_model_file_is_a_plain_state_dict_with_fsdp_and_activation_checkpointing(tmp_path):
    spec = mlp_spec(strategy="fsdp", model=GPT, data={"type": "synthetic_lm", "num_samples": 128, "batch_size": 8},
                    train={"max_steps": 6, "log_every": 3, "eval_every": 3, "eval_fraction": 0.25},
                    fsdp={"activation_checkpointing": True})
    records = run_torchrun(spec, tmp_path / "run")
    evals = {r["step"]: r["metrics"]["eval_loss"] for r in records if "eval_loss" in r.get("metrics", {})}
    assert sorted(evals) == [3, 6] and all(v > 0 for v in evals.values())
    assert summary(records)["model_file"] == "model.pt"
    job_spec = JobSpec.model_validate(spec)
    state = torch.load(tmp_path / "run" / "storage" / "artifacts" / "model.pt", weights_only=True)
    fresh = build_model(job_spec.model, build_dataset(job_spec, tmp_path)[1])
    assert list(state) == list(fresh.state_dict())  # no "module." or checkpoint-wrapper prefixes
    fresh.load_state_dict(state)
    assert json.dumps(summary(records)["parameters"]) == str(sum(p.numel() for p in fresh.parameters()))


def test_only_complete_checkpoints_count(tmp_path):
    for step, complete in [(4, True), (12, True), (8, True), (16, False)]:
        path = tmp_path / f"step_{step:08d}"
        path.mkdir()
        if complete:
            (path / COMPLETE).write_text("{}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000008", "step_00000012"]
    assert complete_checkpoints(tmp_path / "missing") == []


def test_a_stale_attempt_writes_no_model_file(tmp_path, monkeypatch):
    """Fenced as checkpoints are: once a newer attempt owns the job's folder, the old one's model.pt never lands."""
    job_dir, model = tmp_path / "job", torch.nn.Linear(2, 1)
    job_dir.mkdir()
    d = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    (job_dir / OWNER).write_text("2")
    with pytest.raises(RuntimeError, match="attempt 1 no longer owns the job"):
        save_model(model, d, job_dir / "artifacts")
    assert not (job_dir / "artifacts" / "model.pt").exists()
    (job_dir / OWNER).write_text("1")
    assert save_model(model, d, job_dir / "artifacts") == job_dir / "artifacts" / "model.pt"


class NotAPlainValue:
    """Stands for what a job could put in a checkpoint another job loads: a class the full unpickler builds."""


def test_a_checkpoint_value_other_than_tensors_and_plain_values_is_refused_on_load(tmp_path):
    optim = {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": [0]}]}
    dcp.save({"model": {"w": torch.ones(2)}, "optim": optim}, checkpoint_id=tmp_path / "plain")
    state = {"model": {"w": torch.zeros(2)}, "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0),
                                                                          "foreach": False, "params": [0]}]}}
    dcp.load(state, checkpoint_id=tmp_path / "plain", planner=VettedLoadPlanner())
    assert state["model"]["w"].tolist() == [1.0, 1.0] and state["optim"] == optim

    dcp.save({"model": {"w": torch.ones(2)}, "extra": NotAPlainValue()}, checkpoint_id=tmp_path / "hostile")
    unvetted = {"model": {"w": torch.zeros(2)}, "extra": None}
    dcp.load(unvetted, checkpoint_id=tmp_path / "hostile")  # torch's default planner builds the object
    assert isinstance(unvetted["extra"], NotAPlainValue)
    with pytest.raises(CheckpointException, match="Unsupported global.*NotAPlainValue"):
        dcp.load({"model": {"w": torch.zeros(2)}, "extra": None}, checkpoint_id=tmp_path / "hostile",
                 planner=VettedLoadPlanner())
