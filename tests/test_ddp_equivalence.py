"""DDP averages gradients: 2 ranks x batch 16 trains exactly like 1 rank x batch 32."""

import pytest

from tests.conftest import mlp_spec
from tests.helpers import run_torchrun


def losses(records: list[dict]) -> list[float]:
    return [r["metrics"]["loss"] for r in records if r["type"] == "metrics"]


@pytest.mark.parametrize("model,data", [
    ({"type": "mlp", "hidden": [32, 32]}, {"type": "synthetic_regression", "num_samples": 1024}),
    ({"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 8, "vocab_size": 32},
     {"type": "synthetic_lm", "num_samples": 512}),
], ids=["mlp", "gpt"])
def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path, model, data):
    train = {"max_steps": 25, "log_every": 1, "seed": 3}
    two = mlp_spec(model=model, data={**data, "batch_size": 16}, train=train,
                   resources={"nproc_per_node": 2})
    one = mlp_spec(model=model, data={**data, "batch_size": 32}, train=train,
                   resources={"nproc_per_node": 1})
    loss2 = losses(run_torchrun(two, tmp_path / "two", nproc=2))
    loss1 = losses(run_torchrun(one, tmp_path / "one", nproc=1))
    assert len(loss1) == len(loss2) == 25
    assert loss1[-1] < loss1[0]  # it learns, so the match is not trivial
    assert loss2 == pytest.approx(loss1, abs=1e-5, rel=0)
