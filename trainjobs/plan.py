"""The memory plan behind strategy "auto" and POST /v1/plan: arithmetic on the spec, no torch.

Per device, in bytes, for P parameters, W ranks and k optimizer states per parameter (all fp32):

  DDP   4P parameters + 4P gradients + 4kP optimizer + 4P gradient buckets (DDP copies gradients into
        its own buckets) + activations in fp32 (DDP runs without autocast here)
  FSDP  (4P + 4P + 4kP) / W for the sharded fp32 parameters, gradients and optimizer state (on the host with
        fsdp.cpu_offload) + c * (root + 2 * largest block) for the gathered compute copies (c bytes per
        parameter in the compute precision; the root stays gathered, one block computes while the next is
        prefetched; every unit when reshard_after_forward is off) + 4 * (root + largest block) for the
        unsharded gradients waiting for their reduce-scatter + activations in the compute precision

The terms are summed although activations are freed before the optimizer step runs: an upper bound. The 20%
headroom (HEADROOM) covers what the sum leaves out: the CUDA context, NCCL buffers, allocator fragmentation.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from trainjobs.errors import InvalidRequest
from trainjobs.spec import JobSpec

GiB = 2**30
DEFAULT_GPU_MEMORY = 80 * GiB  # an A100/H100 "80 GB" card, when neither the spec nor a live worker says
DEFAULT_HOST_MEMORY = 16 * GiB  # a CPU job's host, when no live worker says


class WorkerMemory(BaseModel):
    """What one worker offers a job: its GPUs (the smallest one's memory) and its host memory."""

    device: Literal["cuda", "cpu"]
    gpu_count: int = 0
    gpu_memory_bytes: int | None = None
    host_memory_bytes: int | None = None


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    source: Literal["spec", "workers", "default"]
    shared: bool = False  # the ranks of a CPU job share one host's memory

    def per_rank(self, nproc: int) -> int:
        return self.total // nproc if self.shared else self.total


def plan_device(spec: JobSpec, workers: Sequence[WorkerMemory]) -> str:
    """The device kind to plan for; 'auto' is CUDA when the spec gives GPU memory or a live worker has a GPU."""
    if spec.resources.device != "auto":
        return spec.resources.device
    return "cuda" if spec.resources.gpu_memory_gb or any(w.gpu_count for w in workers) else "cpu"


def device_memory(spec: JobSpec, device: str, workers: Sequence[WorkerMemory]) -> DeviceMemory:
    """The spec's gpu_memory_gb (GiB per rank), else the smallest live worker's, else a default."""
    if spec.resources.gpu_memory_gb:
        return DeviceMemory(int(spec.resources.gpu_memory_gb * GiB), "spec")
    if device == "cuda":
        sizes = [w.gpu_memory_bytes for w in workers if w.gpu_count and w.gpu_memory_bytes]
        return DeviceMemory(min(sizes), "workers") if sizes else DeviceMemory(DEFAULT_GPU_MEMORY, "default")
    # NOTE: any worker may take a CPU job, and its ranks share that host's memory.
    sizes = [w.host_memory_bytes for w in workers if w.host_memory_bytes]
    return DeviceMemory(min(sizes) if sizes else DEFAULT_HOST_MEMORY, "workers" if sizes else "default", True)


HEADROOM = 0.8  # auto takes a strategy only if its estimate is at most 80% of the device's memory
MAX_PROCESSES = 64  # resources.nproc_per_node's bound
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class Estimate(BaseModel):
    """Memory of one rank's device under one strategy."""

    strategy: Literal["ddp", "fsdp"]
    world_size: int
    total_bytes: int
    total_gib: float
    breakdown: dict[str, int]  # bytes on the device, by what holds them
    host_bytes: int = 0  # moved off the device by fsdp.cpu_offload


class Plan(BaseModel):
    """Both estimates against the device's memory, what the rule picks and why."""

    requested: Literal["ddp", "fsdp", "auto"]
    strategy: Literal["ddp", "fsdp"] | None  # what the job runs: the request, or the choice for auto
    choice: Literal["ddp", "fsdp"] | None  # what the rule picks; None when nothing fits
    reason: str
    parameters: int
    device: Literal["cuda", "cpu"]
    precision: str  # FSDP's compute precision
    device_memory_bytes: int  # for one rank
    device_memory_gib: float
    device_memory_source: Literal["spec", "workers", "default"]
    limit_gib: float
    ddp: Estimate
    fsdp: Estimate
    suggestions: list[str] = []  # what would fit, when nothing does
    batch_size: int | None = None  # data.batch_size "auto": the micro-batch per rank the plan picked


def limit(memory: DeviceMemory, nproc: int) -> int:
    return int(HEADROOM * memory.per_rank(nproc))


def gib(n: int) -> float:
    return round(n / GiB, 3)


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20)):
        if n >= size // 10:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def unit_parameters(spec: JobSpec) -> tuple[list[int], int]:
    """Parameters of each block (a `model.layers` entry, one FSDP unit) and of the rest (FSDP's root).

    Mirrors worker/train/models.py exactly; tests/test_plan.py compares it with the built models.
    """
    model, data = spec.model, spec.data
    if model.type == "mlp":
        out = data.output_dim if data.type == "synthetic_regression" else data.num_classes
        dims = [data.input_dim, *model.hidden]
        return [a * b + b for a, b in zip(dims, dims[1:], strict=False)], dims[-1] * out + out
    d = model.d_model
    # ln1, ln2 (2d each); qkv (3d^2 + 3d); proj (d^2 + d); mlp (4d^2 + 4d, then 4d^2 + d)
    block = 12 * d * d + 13 * d
    # tok_emb, pos_emb, ln_f, head (no bias)
    root = model.vocab_size * d + model.seq_len * d + 2 * d + d * model.vocab_size
    return [block] * model.n_layer, root


def count_parameters(spec: JobSpec) -> int:
    blocks, root = unit_parameters(spec)
    return sum(blocks) + root


def activation_bytes(spec: JobSpec, *, precision: str, checkpointing: bool) -> int:
    """Saved activations of one micro-batch (data.batch_size samples) on one rank.

    Gradient accumulation runs its micro-batches one after another: it does not change this.
    MLP, per sample, in elements: the input and each layer's output (what the Linears and ReLU/tanh keep),
    GELU's inputs, the head's output and the loss target: sum(dims) + [sum(hidden) for gelu] + 2 * out.
    GPT, per token: 16 * d per block (Korthikanti et al. 2022, "Reducing Activation Recomputation", without
    dropout; SDPA's fused kernels, flash on CPU too, keep no seq_len^2 probabilities), ln_f's input and output
    (2d), the log-softmax the loss keeps and the logits' gradient at the start of backward (2 * vocab).
    With activation checkpointing a block keeps only its input, plus one block's worth live during its
    recompute in backward.
    tests/test_plan.py checks these against the tensors autograd actually saves.
    """
    c, model, data = BYTES[precision], spec.model, spec.data
    if model.type == "mlp":
        out = data.output_dim if data.type == "synthetic_regression" else data.num_classes
        dims, kept = [data.input_dim, *model.hidden], 2 if model.activation == "gelu" else 1
        inner = kept * max(model.hidden, default=0) if checkpointing else (kept - 1) * sum(model.hidden)
        return data.batch_size * (sum(dims) + inner + 2 * out) * c
    d, layers = model.d_model, model.n_layer
    blocks = layers * d + 16 * d if checkpointing else layers * 16 * d
    return data.batch_size * model.seq_len * (blocks + 2 * d + 2 * model.vocab_size) * c


def optimizer_states(spec: JobSpec) -> int:
    """fp32 tensors the optimizer keeps per parameter: AdamW's two moments, SGD's momentum buffer."""
    if spec.optimizer.type == "adamw":
        return 2
    return 1 if spec.optimizer.momentum > 0 else 0


def compute_precision(spec: JobSpec, device: str) -> str:
    """FSDP's param_dtype, as worker/train/strategies.py picks it."""
    return spec.fsdp.mixed_precision or ("bf16" if device == "cuda" else "fp32")


def make_estimate(strategy: Literal["ddp", "fsdp"], world_size: int, parts: dict[str, int],
                  host: int = 0) -> Estimate:
    total = sum(parts.values())
    return Estimate(strategy=strategy, world_size=world_size, total_bytes=total, total_gib=gib(total),
                    breakdown=parts, host_bytes=host)


def estimate_ddp(spec: JobSpec, device: str) -> Estimate:
    p, k = count_parameters(spec), optimizer_states(spec)
    parts = {"parameters": 4 * p, "gradients": 4 * p, "optimizer": 4 * k * p, "gradient_buckets": 4 * p,
             "activations": activation_bytes(spec, precision="fp32", checkpointing=False)}
    return make_estimate("ddp", spec.world_size, parts)


def estimate_fsdp(spec: JobSpec, device: str) -> Estimate:
    blocks, root = unit_parameters(spec)
    p, k, w, cfg = sum(blocks) + root, optimizer_states(spec), spec.world_size, spec.fsdp
    precision = compute_precision(spec, device)
    shard = -(-p // w)
    largest = max(blocks, default=0)
    gathered = min(p, root + 2 * largest) if cfg.reshard_after_forward else p
    sharded = {"parameters": 4 * shard, "gradients": 4 * shard, "optimizer": 4 * k * shard}
    host = 0
    if cfg.cpu_offload and device == "cuda":
        host, sharded = sum(sharded.values()), {}
    parts = {**sharded, "gathered_parameters": BYTES[precision] * gathered,
             "unsharded_gradients": 4 * (root + largest),
             "activations": activation_bytes(spec, precision=precision,
                                             checkpointing=cfg.activation_checkpointing)}
    return make_estimate("fsdp", w, parts, host)


def with_changes(spec: JobSpec, *, nproc: int | None = None, **fsdp) -> JobSpec:
    resources = spec.resources.model_copy(update={"nproc_per_node": nproc} if nproc else {})
    return spec.model_copy(update={"resources": resources, "fsdp": spec.fsdp.model_copy(update=fsdp)})


def suggest(spec: JobSpec, device: str, memory: DeviceMemory) -> list[str]:
    """What would make FSDP fit: more processes, activation checkpointing, bf16, CPU offload, or all of them."""
    nproc, out = spec.resources.nproc_per_node, []
    for n in range(nproc + 1, MAX_PROCESSES + 1):
        need = estimate_fsdp(with_changes(spec, nproc=n), device).total_bytes
        if need <= limit(memory, n):
            out.append(f"strategy fsdp with resources.nproc_per_node {n} ({human(need)} per device)")
            break
    tweaks = {}
    if not spec.fsdp.activation_checkpointing:
        tweaks["fsdp.activation_checkpointing true"] = {"activation_checkpointing": True}
    if compute_precision(spec, device) == "fp32":
        tweaks["fsdp.mixed_precision bf16"] = {"mixed_precision": "bf16"}
    if device == "cuda" and not spec.fsdp.cpu_offload:
        tweaks["fsdp.cpu_offload true"] = {"cpu_offload": True}
    tried = list(tweaks.items())
    if len(tweaks) > 1:  # tried last, and only said when no single change is enough
        tried.append((" and ".join(tweaks), {k: v for change in tweaks.values() for k, v in change.items()}))
    fits = []
    for i, (text, change) in enumerate(tried):
        need = estimate_fsdp(with_changes(spec, **change), device).total_bytes
        if need <= limit(memory, nproc) and (i < len(tweaks) or not fits):
            fits.append(f"strategy fsdp with {text} ({human(need)} per device)")
    return out + fits


AUTO_BATCH_MAX = 256  # per rank: data.batch_size "auto" picks no more (a larger batch changes the training)


def make_plan(spec: JobSpec, workers: Sequence[WorkerMemory] = ()) -> Plan:
    """DDP when it fits with 20% headroom, else FSDP when it does, else nothing (with what would fit); with
    data.batch_size "auto", for the largest micro-batch that fits."""
    if spec.model is None:
        raise InvalidRequest("an entrypoint job runs its own code: there is no model to plan", field="model")
    if spec.data.batch_size != "auto":
        return _plan(spec, workers)
    bound = min(AUTO_BATCH_MAX, samples_per_rank(spec) or AUTO_BATCH_MAX)
    if bound < 1:
        raise InvalidRequest("data.batch_size 'auto': the dataset gives no sample per rank", field="data.batch_size")
    size = 1 << (bound.bit_length() - 1)  # the largest power of two within the bound
    while True:
        plan = _plan(with_batch(spec, size), workers)
        cap = int(HEADROOM * plan.device_memory_bytes)
        if size == 1 or (plan.strategy is not None and getattr(plan, plan.strategy).total_bytes <= cap):
            break
        size //= 2
    why = (f"data.batch_size auto: {size} per rank, the largest power of two up to {bound} that fits"
           if size > 1 or plan.choice else "data.batch_size auto: even 1 per rank does not fit")
    return plan.model_copy(update={"batch_size": size, "reason": f"{why}; {plan.reason}"})


def with_batch(spec: JobSpec, size: int) -> JobSpec:
    return spec.model_copy(update={"data": spec.data.model_copy(update={"batch_size": size})})


def samples_per_rank(spec: JobSpec) -> int | None:
    """The most samples one rank's batch can take from the dataset (train split, and the held-out one when it is
    evaluated); None where the size is known only to the worker (a text file)."""
    total = getattr(spec.data, "num_samples", None)
    if total is None:
        return None
    if spec.train.eval_every:
        held = max(1, int(total * spec.train.eval_fraction))  # as worker/train/data.py split_eval holds it out
        total = min(total - held, held)
    return total // spec.world_size


def _plan(spec: JobSpec, workers: Sequence[WorkerMemory]) -> Plan:
    device = plan_device(spec, workers)
    memory = device_memory(spec, device, workers)
    nproc = spec.resources.nproc_per_node
    cap, per_rank = limit(memory, nproc), memory.per_rank(nproc)
    ddp, fsdp = estimate_ddp(spec, device), estimate_fsdp(spec, device)
    source = {"spec": "resources.gpu_memory_gb", "workers": "the smallest live worker",
              "default": f"the default for {device}"}[memory.source]
    if memory.shared and nproc > 1:
        source += f": {human(memory.total)} shared by {nproc} ranks"
    against = f"the limit is {human(cap)} ({HEADROOM:.0%} of {human(per_rank)} per device, from {source})"
    needs = (f"DDP needs {human(ddp.total_bytes)} per device, FSDP over {fsdp.world_size} ranks "
             f"{human(fsdp.total_bytes)}")
    suggestions = []
    if ddp.total_bytes <= cap:
        choice, reason = "ddp", f"DDP fits: {needs}; {against}"
    elif fsdp.total_bytes <= cap:
        choice, reason = "fsdp", f"only FSDP fits: {needs}; {against}"
    else:
        choice, suggestions = None, suggest(spec, device, memory)
        reason = f"nothing fits: {needs}; {against}. " + (
            f"Would fit: {'; '.join(suggestions)}" if suggestions else
            f"no change tried (up to {MAX_PROCESSES} processes, activation checkpointing, bf16, CPU offload on "
            "CUDA) is enough: use a smaller model or data.batch_size")
    if spec.strategy != "auto":
        reason = f"{spec.strategy} requested (the plan only informs); auto would pick {choice or 'nothing'}: {reason}"
    return Plan(requested=spec.strategy, strategy=choice if spec.strategy == "auto" else spec.strategy,
                choice=choice, reason=reason, parameters=count_parameters(spec), device=device,
                precision=compute_precision(spec, device), device_memory_bytes=per_rank,
                device_memory_gib=gib(per_rank), device_memory_source=memory.source, limit_gib=gib(cap),
                ddp=ddp, fsdp=fsdp, suggestions=suggestions)


def resolve(spec: JobSpec, workers: Sequence[WorkerMemory] = ()) -> tuple[JobSpec, Plan | None]:
    """The spec a worker runs (auto replaced by the choice) and its plan; a 422 when auto finds nothing that fits."""
    if spec.model is None:
        return spec, None
    plan = make_plan(spec, workers)
    if plan.batch_size is not None:
        spec = with_batch(spec, plan.batch_size)
    if spec.strategy == "auto":
        if plan.choice is None:
            raise InvalidRequest(f"strategy 'auto': {plan.reason}", field="strategy")
        spec = spec.model_copy(update={"strategy": plan.choice})
    return spec, plan
