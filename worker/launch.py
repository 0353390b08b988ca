"""Pure: JobSpec -> the torchrun command line and environment (as TorchX's dist.ddp renders one)."""

import os
from dataclasses import dataclass
from pathlib import Path

from service.jobs.spec import JobSpec
from service.storage import ARTIFACTS, CHECKPOINTS

SPEC_FILE = "spec.json"  # in the run dir: the resolved spec the ranks read
RUN_TAG_ENV = "TRAINJOBS_RUN_TAG"  # every process of an attempt carries it: how cancel finds them all


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]


def run_tag(job_id: str, attempt: int) -> str:
    return f"{job_id}.{attempt}"


def render(
    spec: JobSpec,
    *,
    job_id: str,
    attempt: int,
    run_dir: Path,
    python: str,
    data_dir: Path,
    job_dir: Path,
    shutdown_grace_s: float,
    base_env: dict[str, str],
    cpu_count: int,
) -> Launch:
    nproc = spec.resources.nproc_per_node
    argv = [
        python, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--max-restarts", "0",  # retries are the service's decision, with a new attempt
        "--log-dir", str(run_dir / "torchelastic"),  # per-rank error files land here (@record)
        "-m", "worker.train", str(run_dir),
    ]
    env = dict(base_env)
    env.update({
        RUN_TAG_ENV: run_tag(job_id, attempt),
        "TRAINJOBS_JOB_ID": job_id,
        "TRAINJOBS_ATTEMPT": str(attempt),
        "TRAINJOBS_DATA_DIR": str(data_dir.resolve()),
        "TRAINJOBS_CHECKPOINT_DIR": str(job_dir / CHECKPOINTS),
        "TRAINJOBS_ARTIFACTS_DIR": str(job_dir / ARTIFACTS),
        "TRAINJOBS_METRICS_FILE": str(run_dir / "metrics.jsonl"),
        "TORCHELASTIC_ERROR_FILE": str(run_dir / "error.json"),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, int(shutdown_grace_s))),
        # torchrun leaves a torchelastic_* folder (and inductor caches) in TMPDIR: keep them in the run dir.
        "TMPDIR": str(run_dir / "tmp"),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count // nproc)))
    return Launch(argv=argv, env=env)


def default_env() -> dict[str, str]:
    """The worker's environment, less what would confuse a nested torchrun."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in os.environ.items() if k not in drop}
