"""The memory plan's arithmetic against the real models, and the rule that picks DDP, FSDP or nothing."""

import pytest
import torch

from service.errors import InvalidRequest
from trainjobs import plan
from trainjobs.plan import WorkerMemory
from trainjobs.spec import JobSpec
from worker.train.data import DataInfo
from worker.train.models import build_model, loss_fn

MODELS = [
    ({"type": "mlp", "hidden": [16]}, {"type": "synthetic_regression"}),
    ({"type": "mlp", "hidden": []}, {"type": "synthetic_regression", "input_dim": 7, "output_dim": 3}),
    ({"type": "mlp", "hidden": [64, 128, 32], "activation": "gelu"},
     {"type": "synthetic_classification", "input_dim": 20, "num_classes": 10}),
    ({"type": "mlp", "hidden": [1000, 3], "activation": "tanh"},
     {"type": "synthetic_regression", "input_dim": 1, "output_dim": 5}),
    ({"type": "gpt"}, {"type": "synthetic_lm"}),
    ({"type": "gpt", "n_layer": 3, "n_head": 4, "d_model": 96, "seq_len": 33, "vocab_size": 300},
     {"type": "synthetic_lm"}),
    ({"type": "gpt", "n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": 2, "vocab_size": 2}, {"type": "synthetic_lm"}),
    ({"type": "gpt", "n_layer": 6, "n_head": 8, "d_model": 256, "seq_len": 128, "vocab_size": 256},
     {"type": "text", "path": "corpus.txt"}),
]


def job(model: dict, data: dict, **overrides) -> JobSpec:
    return JobSpec.model_validate({"model": model, "data": data, **overrides})


def data_info(spec: JobSpec) -> DataInfo:
    d = spec.data
    if d.type == "synthetic_regression":
        return DataInfo("regression", d.input_dim, d.output_dim)
    if d.type == "synthetic_classification":
        return DataInfo("classification", d.input_dim, d.num_classes)
    return DataInfo("lm", tokens_per_sample=spec.model.seq_len)


def built(spec: JobSpec) -> torch.nn.Module:
    return build_model(spec.model, data_info(spec))


def gpt_spec(**overrides) -> JobSpec:
    model = {"type": "gpt", "n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 50257}
    resources = {"nproc_per_node": 4, "device": "cuda", **overrides.pop("resources", {})}
    overrides.setdefault("strategy", "auto")
    return job(model, {"type": "synthetic_lm", "batch_size": 8}, resources=resources, **overrides)


@pytest.mark.parametrize("model,data", MODELS, ids=[f"{m['type']}{i}" for i, (m, _) in enumerate(MODELS)])
def test_parameter_count_equals_the_built_model(model, data):
    spec = job(model, data)
    net = built(spec)
    assert plan.count_parameters(spec) == sum(p.numel() for p in net.parameters())
    blocks, root = plan.unit_parameters(spec)  # the FSDP units: each block of model.layers, then the root
    assert blocks == [sum(p.numel() for p in b.parameters()) for b in net.layers]
    assert root == sum(p.numel() for p in net.parameters()) - sum(blocks)


def saved_activation_bytes(spec: JobSpec, dtype: torch.dtype) -> int:
    """Bytes of the distinct tensors autograd saves in one forward pass (parameters and int inputs aside)."""
    net = built(spec).to(dtype)
    b = spec.data.batch_size
    if spec.model.type == "gpt":
        inputs = torch.randint(0, spec.model.vocab_size, (b, spec.model.seq_len))
        targets, task = inputs.clone(), "lm"
    else:
        inputs, task = torch.randn(b, spec.data.input_dim, dtype=dtype), "regression"
        targets = torch.randn(b, spec.data.output_dim, dtype=dtype)
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(task, net(inputs), targets)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("model,dtype", [
    ({"type": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 256}, torch.float32),
    ({"type": "gpt", "n_layer": 2, "n_head": 8, "d_model": 256, "seq_len": 256, "vocab_size": 1000}, torch.bfloat16),
    ({"type": "mlp", "hidden": [256, 512, 128]}, torch.float32),
    ({"type": "mlp", "hidden": [256, 512, 128], "activation": "gelu"}, torch.float32),
], ids=["gpt-fp32", "gpt-bf16", "mlp-relu", "mlp-gelu"])
def test_activation_estimate_is_close_to_what_autograd_saves(model, dtype):
    data = {"type": "synthetic_lm", "batch_size": 4} if model["type"] == "gpt" else \
        {"type": "synthetic_regression", "batch_size": 64, "input_dim": 32, "output_dim": 1}
    spec = job(model, data)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    estimate = plan.activation_bytes(spec, precision=precision, checkpointing=False)
    saved = saved_activation_bytes(spec, dtype)
    # The estimate also holds the logits' gradient at the start of backward, so it may be a little above.
    assert 0.95 * saved <= estimate <= 1.3 * saved, (estimate, saved)


def test_auto_picks_ddp_for_a_small_model():
    spec = job({"type": "mlp", "hidden": [16]}, {"type": "synthetic_regression"}, strategy="auto")
    resolved, p = plan.resolve(spec)
    assert resolved.strategy == "ddp" and p.choice == p.strategy == "ddp" and p.requested == "auto"
    assert p.ddp.total_bytes <= 0.8 * p.device_memory_bytes and p.reason.startswith("DDP fits")


def test_auto_picks_fsdp_when_only_the_shards_fit_the_device():
    roomy = plan.make_plan(gpt_spec(resources={"gpu_memory_gb": 1000}))
    assert roomy.fsdp.total_bytes < roomy.ddp.total_bytes / 2
    between = (roomy.fsdp.total_bytes + roomy.ddp.total_bytes) / 2 / 0.8 / 2**30  # GiB: FSDP fits, DDP does not
    resolved, p = plan.resolve(gpt_spec(resources={"gpu_memory_gb": between}))
    assert resolved.strategy == "fsdp" and p.choice == "fsdp" and p.device_memory_source == "spec"
    assert "only FSDP fits" in p.reason and f"{p.ddp.total_bytes / 2**30:.2f} GiB" in p.reason


def test_auto_with_nothing_fitting_is_refused_naming_strategy_and_what_would_fit():
    spec = gpt_spec(resources={"gpu_memory_gb": 24})
    with pytest.raises(InvalidRequest) as exc:
        plan.resolve(spec)
    p = plan.make_plan(spec)
    assert exc.value.field == "strategy" and exc.value.status_code == 422
    assert f"FSDP over 4 ranks {p.fsdp.total_bytes / 2**30:.2f} GiB" in exc.value.message
    assert "activation_checkpointing" in exc.value.message and "nproc_per_node" in exc.value.message
    n = int(exc.value.message.split("nproc_per_node ")[1].split()[0])  # the fewest processes that fit
    limit = 0.8 * 24 * 2**30
    assert plan.estimate_fsdp(plan.with_changes(spec, nproc=n), "cuda").total_bytes <= limit
    assert plan.estimate_fsdp(plan.with_changes(spec, nproc=n - 1), "cuda").total_bytes > limit


def test_explicit_strategies_are_planned_but_never_refused():
    spec = gpt_spec(strategy="ddp", resources={"gpu_memory_gb": 1})
    resolved, p = plan.resolve(spec)
    assert resolved.strategy == "ddp" and p.strategy == "ddp" and p.choice is None
    assert p.reason.startswith("ddp requested") and p.suggestions == []  # nothing fits even then


def test_bf16_checkpointing_and_offload_shrink_fsdp_and_accumulation_does_not_matter():
    cpu = job({"type": "gpt", "d_model": 512, "n_layer": 4}, {"type": "synthetic_lm", "batch_size": 8},
              resources={"nproc_per_node": 2})
    base = plan.estimate_fsdp(cpu, "cpu")
    assert plan.compute_precision(cpu, "cpu") == "fp32" and plan.compute_precision(cpu, "cuda") == "bf16"
    bf16 = plan.estimate_fsdp(plan.with_changes(cpu, mixed_precision="bf16"), "cpu")
    assert bf16.breakdown["gathered_parameters"] * 2 == base.breakdown["gathered_parameters"]
    assert bf16.breakdown["activations"] * 2 == base.breakdown["activations"]
    ckpt = plan.estimate_fsdp(plan.with_changes(cpu, activation_checkpointing=True), "cpu")
    assert ckpt.breakdown["activations"] < base.breakdown["activations"] / 2
    offload = plan.estimate_fsdp(plan.with_changes(cpu, cpu_offload=True), "cuda")
    shard = -(-plan.count_parameters(cpu) // 2)
    assert "optimizer" not in offload.breakdown and offload.host_bytes == 4 * (1 + 1 + 2) * shard
    accum = cpu.model_copy(update={"train": cpu.train.model_copy(update={"grad_accum_steps": 8})})
    assert plan.estimate_fsdp(accum, "cpu") == base and plan.estimate_ddp(accum, "cpu") == plan.estimate_ddp(cpu, "cpu")
    sgd = cpu.model_copy(update={"optimizer": cpu.optimizer.model_copy(update={"type": "sgd"})})
    assert plan.estimate_ddp(sgd, "cpu").breakdown["optimizer"] == 0


def test_device_memory_comes_from_the_spec_then_live_workers_then_a_default():
    spec = gpt_spec()
    small, big = (WorkerMemory(device="cuda", gpu_count=8, gpu_memory_bytes=g * 2**30, host_memory_bytes=2**40)
                  for g in (40, 80))
    assert plan.make_plan(spec, [big, small]).device_memory_gib == 40  # the smallest live worker's
    assert plan.make_plan(spec).device_memory_source == "default"
    assert plan.make_plan(gpt_spec(resources={"gpu_memory_gb": 141}), [small]).device_memory_gib == 141


def test_cpu_ranks_share_the_host_memory_and_auto_device_follows_the_workers():
    spec = job({"type": "mlp"}, {"type": "synthetic_regression"}, resources={"nproc_per_node": 4, "device": "auto"})
    cpu_worker = WorkerMemory(device="cpu", host_memory_bytes=32 * 2**30)
    p = plan.make_plan(spec, [cpu_worker])
    assert p.device == "cpu" and p.device_memory_gib == 8 and "shared by 4 ranks" in p.reason
    gpu_worker = WorkerMemory(device="cuda", gpu_count=1, gpu_memory_bytes=16 * 2**30, host_memory_bytes=2**36)
    assert plan.make_plan(spec, [cpu_worker, gpu_worker]).device == "cuda"


def test_an_auto_batch_is_the_largest_power_of_two_whose_estimate_fits_and_a_double_would_not():
    model = {"type": "gpt", "n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 2048, "vocab_size": 50257}
    spec = job(model, {"type": "synthetic_lm", "num_samples": 100_000, "batch_size": "auto"},
               resources={"device": "cuda", "gpu_memory_gb": 80})
    resolved, p = plan.resolve(spec)
    size = resolved.data.batch_size
    assert isinstance(size, int) and size == p.batch_size and size & (size - 1) == 0 and 1 < size < plan.AUTO_BATCH_MAX
    cap = 0.8 * p.device_memory_bytes
    assert p.ddp.total_bytes <= cap < plan.make_plan(plan.with_batch(spec, 2 * size)).ddp.total_bytes
    assert p.reason.startswith(f"data.batch_size auto: {size} per rank")
    # Roomy memory: the cap (AUTO_BATCH_MAX), and never more than the dataset gives each rank.
    small = job({"type": "mlp", "hidden": [16]}, {"type": "synthetic_regression", "batch_size": "auto"})
    assert plan.resolve(small)[0].data.batch_size == plan.AUTO_BATCH_MAX
    tiny = job({"type": "mlp", "hidden": [16]}, {"type": "synthetic_regression", "num_samples": 100,
                                                 "batch_size": "auto"}, train={"eval_every": 10},
               resources={"nproc_per_node": 2})
    assert plan.resolve(tiny)[0].data.batch_size == 4  # 10 held out, over 2 ranks: 5, the power of two 4
