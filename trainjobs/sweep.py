"""SweepSpec: a search over a job spec's fields (issue 17), and the trials it asks for (pure, seeded).

A sweep names a base spec, the dotted paths to vary and how ({values: [...]} or a distribution), grid or random
search, how many trials and how many at once, the metric to judge by and an early-stopping rule
(trainjobs/stopping.py). Trial n's parameters depend only on the sweep and n, so a controller that restarts
makes the same trial n again, never another.
"""

import math
import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainjobs.errors import InvalidRequest
from trainjobs.spec import JobSpec, Name, with_overrides

MAX_TRIALS = 1000
Path = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")]
Scalar = float | int | str | bool | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Values(_Strict):
    """One of these values (grid: each in turn; random: one drawn uniformly)."""

    values: list[Any] = Field(min_length=1, max_length=100)


class Distribution(_Strict):
    """A number drawn between min and max (random search only): uniform, log-uniform, or an integer."""

    distribution: Literal["uniform", "log_uniform", "int_uniform"]
    min: float
    max: float

    @model_validator(mode="after")
    def _bounds(self):
        if self.min >= self.max:
            raise ValueError("min must be below max")
        if self.distribution == "log_uniform" and self.min <= 0:
            raise ValueError("log_uniform needs min > 0")
        if self.distribution == "int_uniform" and not (self.min.is_integer() and self.max.is_integer()):
            raise ValueError("int_uniform needs whole-number min and max")
        return self

    def extremes(self) -> list[float | int]:
        if self.distribution == "int_uniform":
            return [int(self.min), int(self.max)]
        return [self.min, self.max]


Parameter = Values | Distribution


class Metric(_Strict):
    name: str = Field(min_length=1, max_length=64, description="a series the trials report, e.g. loss, eval_loss")
    goal: Literal["minimize", "maximize"] = "minimize"


class NoStopping(_Strict):
    type: Literal["none"] = "none"


class Asha(_Strict):
    """Asynchronous successive halving: rungs at min_steps × reduction_factor^k; at each, a trial goes on only if
    its metric is in the top 1/reduction_factor of the trials that reached that rung before it."""

    type: Literal["asha"]
    min_steps: int = Field(ge=1, le=100_000_000)
    reduction_factor: int = Field(3, ge=2, le=100)


class Median(_Strict):
    """Median stopping: past min_steps, a trial whose best so far is worse than the median of the other trials'
    running averages at the same step stops (once at least min_trials others got there)."""

    type: Literal["median"]
    min_steps: int = Field(ge=1, le=100_000_000)
    min_trials: int = Field(3, ge=1, le=MAX_TRIALS)


EarlyStopping = Annotated[NoStopping | Asha | Median, Field(discriminator="type")]


class SweepSpec(_Strict):
    name: Name = "sweep"
    spec: JobSpec
    parameters: dict[Path, Parameter] = Field(min_length=1, max_length=16)
    method: Literal["grid", "random"] = "random"
    max_trials: int | None = Field(None, ge=1, le=MAX_TRIALS, description="random: required (default 10); "
                                   "grid: at most every combination (the default)")
    parallel: int = Field(2, ge=1, le=64, description="trials queued or running at once")
    metric: Metric = Field(default_factory=lambda: Metric(name="loss"))
    early_stopping: EarlyStopping | None = None
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="random search's; default: drawn at submission")

    @model_validator(mode="after")
    def _method_fits(self):
        if self.method == "grid":
            for path, p in self.parameters.items():
                if isinstance(p, Distribution):
                    raise ValueError(f"grid search needs values for every parameter: {path} is a distribution")
            if self.max_trials is not None and self.max_trials > self.grid_size():
                raise ValueError(f"max_trials {self.max_trials} is more than the grid's {self.grid_size()} "
                                 "combinations")
            if self.max_trials is None and self.grid_size() > MAX_TRIALS:
                raise ValueError(f"the grid has {self.grid_size()} combinations, more than {MAX_TRIALS}: set "
                                 "max_trials to run its first ones")
        return self

    def grid_size(self) -> int:
        return math.prod(len(p.values) for p in self.parameters.values() if isinstance(p, Values))

    @property
    def total_trials(self) -> int:
        if self.method == "grid":
            return self.max_trials or self.grid_size()
        return self.max_trials or 10

    @property
    def stopping(self) -> Asha | Median | None:
        return None if isinstance(self.early_stopping, NoStopping) else self.early_stopping


def trial_parameters(sweep: SweepSpec, index: int) -> dict[str, Any]:
    """Trial `index`'s parameters: the grid's combination `index` (the last parameter varies fastest), or a draw
    seeded by (seed, index) alone, so trial n is the same whenever and however often it is asked for."""
    if not 0 <= index < sweep.total_trials:
        raise IndexError(f"trial {index} is outside 0..{sweep.total_trials - 1}")
    if sweep.method == "grid":  # index in mixed radix, the last parameter's digit lowest
        found, rest = {}, index
        for path, p in reversed(sweep.parameters.items()):
            rest, digit = divmod(rest, len(p.values))
            found[path] = p.values[digit]
        return {path: found[path] for path in sweep.parameters}
    rng = random.Random(f"{sweep.seed or 0}:{index}")  # a str seed is hashed (sha512): stable across runs
    return {path: draw(p, rng) for path, p in sweep.parameters.items()}


def draw(p: Parameter, rng: random.Random) -> Any:
    if isinstance(p, Values):
        return p.values[rng.randrange(len(p.values))]
    if p.distribution == "uniform":
        return rng.uniform(p.min, p.max)
    if p.distribution == "log_uniform":
        return math.exp(rng.uniform(math.log(p.min), math.log(p.max)))
    return rng.randint(int(p.min), int(p.max))


def trial_spec(sweep: SweepSpec, *, sweep_id: str, index: int, params: dict[str, Any]) -> JobSpec:
    """The base spec with the trial's parameters set, named `<sweep>-<index>` and tagged `sweep:<id>`."""
    spec = with_overrides(sweep.spec, params, field="parameters")
    tags = list(dict.fromkeys([*spec.tags, f"sweep:{sweep_id}"]))[-32:]
    return spec.model_copy(update={"name": f"{sweep.name}-{index}"[:128], "tags": tags})


def check(sweep: SweepSpec) -> None:
    """What a submission must refuse before any trial exists: a path the spec does not have, a value (or a
    distribution's extreme) it refuses, a metric the runtime will never report. InvalidRequest names the field."""
    for path, p in sweep.parameters.items():
        for value in p.values if isinstance(p, Values) else p.extremes():
            try:
                with_overrides(sweep.spec, {path: value}, field="parameters")
            except InvalidRequest as exc:
                raise InvalidRequest(f"parameters.{path}: {exc.message} (value {value!r})",
                                     field=f"parameters.{path}") from None
    if sweep.method == "grid":  # every combination, together (at most MAX_TRIALS)
        for index in range(sweep.total_trials):
            trial_spec(sweep, sweep_id="0" * 20, index=index, params=trial_parameters(sweep, index))
    base = sweep.spec
    if base.entrypoint is None and sweep.metric.name == "eval_loss" and base.train.eval_every is None:
        raise InvalidRequest("metric eval_loss is reported only with spec.train.eval_every set",
                             field="metric.name")
    stopping = sweep.stopping
    if stopping is not None and base.entrypoint is None and stopping.min_steps >= base.train.max_steps:
        raise InvalidRequest(f"early_stopping.min_steps ({stopping.min_steps}) must be below spec.train.max_steps "
                             f"({base.train.max_steps})", field="early_stopping.min_steps")
