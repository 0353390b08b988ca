"""DDP averages gradients and FSDP shards them: 2 ranks x batch 16 train exactly like 1 rank x batch 32.

So do 2 ranks x 2 micro-batches of 8 (gradient accumulation, no sync on the inner one), with activation
checkpointing under FSDP: recomputing activations changes memory, not the numbers.
"""

import pytest

from tests.conftest import mlp_spec
from tests.helpers import run_torchrun


def losses(records: list[dict]) -> list[float]:
    return [r["metrics"]["loss"] for r in records if r["type"] == "metrics"]


@pytest.mark.parametrize("model,data,accumulated", [
    ({"type": "mlp", "hidden": [32, 32]}, {"type": "synthetic_regression", "num_samples": 1024},
     {"strategy": "ddp"}),
    ({"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8, "vocab_size": 32},
     {"type": "synthetic_lm", "num_samples": 512}, {"strategy": "fsdp", "fsdp": {"activation_checkpointing": True}}),
], ids=["mlp", "gpt"])
def test_ddp_and_fsdp_on_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path, model, data, accumulated):
    def spec(strategy: str, nproc: int, accum: int = 1, **extra) -> dict:
        train = {"max_steps": 25, "log_every": 1, "seed": 3, "grad_accum_steps": accum}
        return mlp_spec(strategy=strategy, model=model, data={**data, "batch_size": 32 // nproc // accum},
                        train=train, resources={"nproc_per_node": nproc}, **extra)

    one = losses(run_torchrun(spec("ddp", 1), tmp_path / "one"))
    ddp = losses(run_torchrun(spec("ddp", 2), tmp_path / "ddp"))
    fsdp = losses(run_torchrun(spec("fsdp", 2), tmp_path / "fsdp"))
    accum = losses(run_torchrun(spec(nproc=2, accum=2, **accumulated), tmp_path / "accum"))
    assert len(one) == len(ddp) == len(fsdp) == len(accum) == 25
    assert one[-1] < one[0]  # it learns, so the match is not trivial
    assert ddp == pytest.approx(one, abs=1e-5, rel=0)
    assert fsdp == pytest.approx(one, abs=1e-5, rel=0)
    assert accum == pytest.approx(one, abs=1e-5, rel=0)
