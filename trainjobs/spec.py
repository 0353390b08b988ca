"""JobSpec: the one contract between the API, the CLI and the worker (pydantic only)."""

import re
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainjobs import runenv
from trainjobs.errors import InvalidRequest

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\- ]*$")]
Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:=/\-]*$")]
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


REQUIREMENTS_MAX = 200


def _relative(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return not path.startswith("/") and ".." not in parts and "\0" not in path


RelativePath = Annotated[str, Field(min_length=1, max_length=1024)]


def requirement_problem(line: str) -> str | None:
    """Why `line` is not one plain requirement (PEP 508: a name, extras, a version range, markers, or an URL).

    pip's options (-r, -e, --index-url, ...) are not requirements: where pip installs from is the worker's
    configuration, and a file or an editable path would point into the worker's disk.
    """
    text = line.strip()
    if not text or "\n" in line or "\r" in line or "\0" in line:
        return "one requirement per item, not empty"
    if text.startswith("-"):
        return "pip options are not allowed, only requirements such as 'name==1.2'"
    try:
        requirement = Requirement(text)
    except InvalidRequirement as exc:
        return f"not a valid requirement ({str(exc).splitlines()[0]})"
    if requirement.url is not None and not requirement.url.startswith(("https://", "http://")):
        return "a direct reference must be an http(s) URL, not a path on the worker"
    return None


def direct_reference(line: str) -> str | None:
    """The URL of a direct reference (`name @ https://...`), else None. Where pip fetches it from is the job's
    choice, not the operator's index: a service takes them only where its operator allows them
    (TRAINJOBS_ALLOW_DIRECT_URLS)."""
    try:
        return Requirement(line.strip()).url
    except InvalidRequirement:
        return None


def read_requirements(text: str) -> list[str]:
    """A requirements file's requirement lines: comments, blank lines and line continuations handled."""
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        line, current = (current + line).strip(), ""
        if line:
            lines.append(line)
    return lines


class _Strict(BaseModel):
    # An unknown field is a typo the user wants to hear about, not something to drop; NaN and infinities are
    # not JSON (the API refuses them), so a spec built in Python refuses them too.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Resources(_Strict):
    nnodes: int = Field(1, ge=1, le=1024)
    nproc_per_node: int = Field(1, ge=1, le=64)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=10_000, description="memory per device for the plan; default: what live workers report")
    selector: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=256)]] = Field(
        default_factory=dict, max_length=32, description="worker labels every node must carry (--label k=v)")


class MLPConfig(_Strict):
    type: Literal["mlp"]
    hidden: list[Annotated[int, Field(ge=1, le=65536)]] = Field(default_factory=lambda: [64, 64], max_length=32)
    activation: Literal["relu", "gelu", "tanh"] = "relu"


class GPTConfig(_Strict):
    type: Literal["gpt"]
    n_layer: int = Field(2, ge=1, le=128)
    n_head: int = Field(2, ge=1, le=128)
    d_model: int = Field(64, ge=8, le=16384)
    seq_len: int = Field(64, ge=2, le=32768)
    vocab_size: int = Field(256, ge=2, le=1_000_000)

    @model_validator(mode="after")
    def _heads_divide_width(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


ModelConfig = Annotated[MLPConfig | GPTConfig, Field(discriminator="type")]

NumSamples = Annotated[int, Field(ge=1, le=50_000_000)]
# Per rank. "auto": the memory plan picks the largest power of two up to trainjobs.plan.AUTO_BATCH_MAX that fits
# the device with the plan's headroom (and the dataset), and the job is stored with that number.
BatchSize = Annotated[int, Field(ge=1, le=65536, description="per rank")] | Literal["auto"]


class SyntheticRegression(_Strict):
    type: Literal["synthetic_regression"]
    num_samples: NumSamples = 4096
    batch_size: BatchSize = 32
    input_dim: int = Field(16, ge=1, le=65536)
    output_dim: int = Field(1, ge=1, le=65536)
    noise: float = Field(0.01, ge=0, le=100)
    seed: Seed = 0


class SyntheticClassification(_Strict):
    type: Literal["synthetic_classification"]
    num_samples: NumSamples = 4096
    batch_size: BatchSize = 32
    input_dim: int = Field(16, ge=1, le=65536)
    num_classes: int = Field(4, ge=2, le=100_000)
    seed: Seed = 0


class SyntheticLM(_Strict):
    """Token sequences from a fixed sparse Markov chain: learnable, so loss falls."""

    type: Literal["synthetic_lm"]
    num_samples: NumSamples = 4096
    batch_size: BatchSize = 16
    branching: int = Field(2, ge=1, le=64, description="likely successors per token")
    seed: Seed = 0


class TextData(_Strict):
    """Byte-level language modelling over a UTF-8 file under the data directory."""

    type: Literal["text"]
    path: str = Field(min_length=1, max_length=1024, description="relative to TRAINJOBS_DATA_DIR")
    batch_size: BatchSize = 16


DataConfig = Annotated[
    SyntheticRegression | SyntheticClassification | SyntheticLM | TextData, Field(discriminator="type")
]
LM_DATA = ("synthetic_lm", "text")


class OptimizerConfig(_Strict):
    type: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0, le=10)
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    grad_clip: float | None = Field(None, gt=0, le=1e6)


class FSDPConfig(_Strict):
    """FSDP2 (fully_shard) options: each block is sharded, then the root."""

    mixed_precision: Literal["bf16", "fp16", "fp32"] | None = Field(
        None, description="default: bf16 on CUDA, fp32 on CPU")
    reshard_after_forward: bool = True
    activation_checkpointing: bool = Field(False, description="recompute each block's activations in backward")
    cpu_offload: bool = Field(False, description="keep sharded parameters and optimizer state in host memory")


class TrainConfig(_Strict):
    max_steps: int = Field(100, ge=1, le=100_000_000)
    log_every: int = Field(10, ge=1, le=1_000_000)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    grad_accum_steps: int = Field(1, ge=1, le=1024, description="micro-batches per optimizer step")
    eval_every: int | None = Field(None, ge=1, le=100_000_000, description="steps between evaluations")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="share of the data held out for evaluation")
    eval_batches: int = Field(16, ge=1, le=100_000, description="batches per rank in one evaluation")
    checkpoint_every: int | None = Field(None, ge=1, le=100_000_000, description="steps between checkpoints")
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="complete checkpoints kept")
    stop_on_nan: bool = Field(True, description="fail the run (not retried) once the loss is NaN or infinite; "
                              "checked on log steps")
    compile: bool | None = Field(None, description="torch.compile the model (each block under FSDP, the whole "
                                 "model under DDP); null: on for CUDA, off for CPU")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile's backend: inductor generates kernels; aot_eager and eager only trace "
        "(to find a compile problem)")
    autocast: bool = Field(True, description="DDP on CUDA: the forward in bf16 autocast (parameters, gradients and "
                           "optimizer stay fp32); false: fp32 with TF32 matmuls. FSDP's precision is "
                           "fsdp.mixed_precision")


class FaultInjection(_Strict):
    """Make one rank raise (or block forever) at a step: to test failure handling, hang detection and retries."""

    raise_at_step: int | None = Field(None, ge=0, le=100_000_000)
    hang_at_step: int | None = Field(None, ge=0, le=100_000_000, description="the rank sleeps forever there")
    sleep_per_step_s: float | None = Field(None, gt=0, le=60, description="the rank sleeps this long every step: "
                                           "a straggler")
    rank: int = Field(0, ge=0, le=65_535)
    message: str = Field("injected fault", max_length=500)
    attempt: int | None = Field(1, ge=1, le=11, description="only on this attempt (null: on every attempt)")

    @model_validator(mode="after")
    def _one_fault(self):
        if sum(x is not None for x in (self.raise_at_step, self.hang_at_step, self.sleep_per_step_s)) != 1:
            raise ValueError("fault_injection needs exactly one of 'raise_at_step', 'hang_at_step' or "
                             "'sleep_per_step_s'")
        return self


class InitFrom(_Strict):
    """Start from another job's model weights (not its optimizer or step): a fine-tune."""

    job: str = Field(pattern=r"^[0-9a-f]{20}$", description="your own job (any, for admins)")
    checkpoint: Literal["final", "latest"] = Field("final", description="final: its artifacts/model.pt; latest: "
                                                   "its newest complete checkpoint")


class StragglerConfig(_Strict):
    """When a rank of the built-in runtime is named a straggler (unset: the worker's defaults)."""

    enabled: bool = Field(True, description="false: the runtime neither times each rank's own step nor gathers "
                          "it (no step_time_s/rank<r> series), and no rank is named")
    factor: float | None = Field(None, gt=1, le=100, description="its own step time at least this many times the "
                                 "median of the others' (default TRAINJOBS_STRAGGLER_FACTOR, 1.3)")
    windows: int | None = Field(None, ge=1, le=1000, description="for this many log windows in a row "
                                "(default TRAINJOBS_STRAGGLER_WINDOWS, 3)")


class HangConfig(_Strict):
    """When a job that stopped making progress is hung, and what then (unset: the worker's defaults)."""

    enabled: bool = Field(True, description="false: the worker never calls the job hung (POST .../stacks still "
                          "works)")
    min_s: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="never hung sooner than this "
                                "(default TRAINJOBS_HANG_MIN_S, 300)")
    factor: float | None = Field(None, ge=1, le=10_000, description="hung after this many median step times "
                                 "without a step, if that is longer than min_s (default TRAINJOBS_HANG_FACTOR, 10)")
    startup_s: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="before the ranks' first output or "
                                    "step (imports, rendezvous) the bound is at least this (default "
                                    "TRAINJOBS_HANG_STARTUP_S, 600)")
    action: Literal["retry", "fail", "report"] | None = Field(
        None, description="retry: a new attempt from the last checkpoint (a second hang fails the job); fail; "
        "report: keep running, record the stacks and an event (default TRAINJOBS_HANG_ACTION, retry)")


class IdleConfig(_Strict):
    """When a job's devices are idle (on CPU: every rank's CPU), and what then (unset: the worker's defaults)."""

    enabled: bool = Field(True, description="false: no idle rule, and the worker samples no usage series for "
                          "the job")
    min_util: float | None = Field(None, ge=0, le=100, description="idle below this utilisation, in percent: of "
                                   "each GPU, or on CPU of one core per rank (default TRAINJOBS_IDLE_MIN_UTIL, 5)")
    window_s: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="for this long without a break "
                                   "(default TRAINJOBS_IDLE_WINDOW_S, 600): a job that ends sooner is never idle")
    action: Literal["warn", "fail"] | None = Field(
        None, description="warn: a warning and an event, once per attempt; fail: the job fails with 'idle', "
        "never retried (default TRAINJOBS_IDLE_ACTION, warn)")


class Entrypoint(_Strict):
    """The user's own training code, run under torchrun instead of the built-in runtime."""

    module: str | None = Field(None, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
                               description="run as python -m MODULE")
    script: str | None = Field(None, min_length=1, max_length=1024,
                               description="relative to the package's root, else to TRAINJOBS_SCRIPTS_DIR")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=256)
    package: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$",
                                description="an uploaded working directory (PUT /v1/packages/sha256:<hex>): the "
                                "ranks run in a copy of it")
    requirements: list[Annotated[str, Field(min_length=1, max_length=512)]] | RelativePath | None = Field(
        None, description="pip requirements installed into a virtualenv layered on the worker's (torch stays the "
        "worker's): a list of lines, or the name of a requirements file in the package")

    @field_validator("requirements")
    @classmethod
    def _plain_requirements(cls, value):
        if isinstance(value, list):
            if len(value) > REQUIREMENTS_MAX:
                raise ValueError(f"at most {REQUIREMENTS_MAX} requirements")
            for i, line in enumerate(value):
                if problem := requirement_problem(line):
                    raise ValueError(f"requirements[{i}] {line!r}: {problem}")
        return value

    @model_validator(mode="after")
    def _one_target(self):
        if (self.module is None) == (self.script is None):
            raise ValueError("entrypoint needs exactly one of 'module' or 'script'")
        if self.script is not None and not _relative(self.script):
            raise ValueError("entrypoint.script must be a relative path inside the scripts directory")
        if isinstance(self.requirements, str) and not _relative(self.requirements):
            raise ValueError("entrypoint.requirements must be a relative path inside the package")
        if isinstance(self.requirements, str) and self.package is None:
            raise ValueError("entrypoint.requirements names a file in the package: it needs entrypoint.package "
                             "(or give the requirements as a list)")
        return self


# An image reference as Docker's distribution/reference reads one: [registry[:port]/]path[:tag][@sha256:hex].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?/)?"
_TAG, _DIGEST = r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?", r"(?:@sha256:[0-9a-f]{64})?"
IMAGE_REFERENCE = rf"^{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*{_TAG}{_DIGEST}$"
IMAGES_LABEL = "trainjobs.io/images"  # "on": the worker pulls and runs images (worker/images.py)


def _image_reference(value: str) -> str:
    if not re.match(IMAGE_REFERENCE, value):
        raise ValueError(f"{value[:100]!r} is not an image reference: registry/repository:tag or "
                         "repository@sha256:<64 hex digits>, lowercase repository names")
    return value


ImageRef = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_image_reference)]

EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
EnvValue = Annotated[str, Field(max_length=4096)]
ENV_MAX_VARS, ENV_MAX_BYTES = 64, 32 * 1024


class JobSpec(_Strict):
    """A training job as the user submits it."""

    name: Name = "job"
    tags: list[Tag] = Field(default_factory=list, max_length=32, description="free labels, e.g. team=vision")
    strategy: Literal["ddp", "fsdp", "auto"] = Field(
        "ddp", description="auto: DDP or FSDP from the memory plan (trainjobs/plan.py), stored as the choice")
    resources: Resources = Field(default_factory=Resources)
    model: ModelConfig | None = None
    data: DataConfig | None = None
    entrypoint: Entrypoint | None = None
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    priority: Literal["high", "normal", "low"] = "normal"
    preemptible: bool = Field(True, description="a higher-priority job may hand it back to the queue (it resumes "
                              "from its checkpoint); false only for admins")
    max_retries: int = Field(0, ge=0, le=10)
    timeout_s: float = Field(3600, gt=0, le=7 * 24 * 3600)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    fault_injection: FaultInjection | None = None
    hang: HangConfig = Field(default_factory=HangConfig)
    straggler: StragglerConfig = Field(default_factory=StragglerConfig)
    idle: IdleConfig = Field(default_factory=IdleConfig)
    init_from: InitFrom | None = Field(None, description="the built-in runtime loads these weights before step 0; "
                                       "a script gets their path in TRAINJOBS_INIT_FROM")
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict, max_length=ENV_MAX_VARS,
        description="environment variables for every rank (not secrets: anyone who can read the job sees them)")
    image: ImageRef | None = Field(None, description="a container image (registry/repo:tag or repo@sha256:...) whose "
                                   "root filesystem the ranks run in: its python3 and torch, not the worker's; only "
                                   f"workers labelled {IMAGES_LABEL}=on run it (issue 44)")

    @model_validator(mode="after")
    def _image_runs_where_images_run(self):
        """A job with an image needs a worker that pulls images: its selector says so, so placement sends it to one."""
        if self.image is not None:
            if self.entrypoint is not None and self.entrypoint.requirements:
                raise ValueError("entrypoint.requirements layer on the worker's Python and cannot go with an image: "
                                 "install them in the image")
            self.resources.selector.setdefault(IMAGES_LABEL, "on")
        return self

    @field_validator("env")
    @classmethod
    def _env_is_the_users(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if runenv.reserved_env(name):
                raise ValueError(f"env variable {name!r} is reserved: the worker sets it, or it changes how the "
                                 "worker starts its processes")
            if "\0" in env[name]:
                raise ValueError(f"env variable {name!r} holds a NUL byte")
        if (size := sum(len(k) + len(v.encode()) for k, v in env.items())) > ENV_MAX_BYTES:
            raise ValueError(f"env holds {size} bytes; at most {ENV_MAX_BYTES}")
        return env

    @model_validator(mode="after")
    def _model_fits_data(self):
        if self.fault_injection and self.fault_injection.rank >= self.world_size:
            raise ValueError(f"fault_injection.rank must be below the world size ({self.world_size})")
        if self.fsdp.cpu_offload and self.resources.device == "cpu":
            raise ValueError("fsdp.cpu_offload needs resources.device 'cuda' (on CPU everything is in host memory)")
        if self.entrypoint is not None:
            if self.model is not None or self.data is not None:
                raise ValueError("a job with an entrypoint runs its own code: give no model or data")
            if self.strategy == "auto":
                raise ValueError("strategy 'auto' needs a model to plan; an entrypoint job names ddp or fsdp")
            if self.fault_injection is not None:
                raise ValueError("fault_injection works only in the built-in runtime, not with an entrypoint")
            return self
        if self.model is None or self.data is None:
            raise ValueError("a job needs a model and data (or an entrypoint with your own code)")
        is_lm = self.data.type in LM_DATA
        if is_lm and self.model.type != "gpt":
            raise ValueError(f"data.type {self.data.type!r} is language modelling and needs model.type 'gpt'")
        if not is_lm and self.model.type == "gpt":
            raise ValueError(f"model.type 'gpt' needs language-model data ({', '.join(LM_DATA)})")
        if self.data.type == "text" and self.model.vocab_size < 256:
            raise ValueError("data.type 'text' is byte-level: model.vocab_size must be at least 256")
        return self

    @property
    def world_size(self) -> int:
        return self.resources.nnodes * self.resources.nproc_per_node


def with_overrides(spec: JobSpec, overrides: dict[str, Any], *, field: str = "set") -> JobSpec:
    """`spec` with each dotted path of `overrides` set ({"optimizer.lr": 3e-4}), validated as a submission is.

    A path the spec does not have, or a value it refuses, is an InvalidRequest naming `<field>.<path>` (a clone's
    `set.<path>`, a sweep's `parameters.<path>`).
    """
    data = spec.model_dump(mode="json")
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node: Any = data
        for depth, part in enumerate(parents):
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                where = ".".join(parents[: depth + 1])
                raise InvalidRequest(f"{path!r} is not a field of the spec ({where} is "
                                     f"{'not set in the source; set it whole' if node is None else 'not a section'})",
                                     field=f"{field}.{path}")
        if not isinstance(node, dict) or leaf not in node:
            raise InvalidRequest(f"{path!r} is not a field of the spec", field=f"{field}.{path}")
        node[leaf] = value
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"{where}: {first['msg']}", field=f"{field}.{where}" if where else field) from None
