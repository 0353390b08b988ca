"""JobSpec -> the torchrun command line and environment, pure (as TorchX's dist.ddp renders one).

Also the check of an entrypoint job before it launches: the one part here that looks at the disk.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from trainjobs import runenv
from trainjobs.errors import TrainjobsError
from trainjobs.paths import ARTIFACTS, CHECKPOINTS
from trainjobs.spec import JobSpec
from trainjobs.states import ErrorType
from worker.redact import rank_env


class EntrypointRefused(TrainjobsError):
    """A job this worker will not launch as it stands (its own code refused, its init_from gone); `kind` becomes
    the job's error type."""

    def __init__(self, kind: ErrorType, message: str):
        super().__init__(message, field="entrypoint")
        self.kind = kind


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Gang:
    """One node of a multi-node job: where the rendezvous is and who this node is."""

    nnodes: int
    node_rank: int
    endpoint: str  # host:port on node 0, which hosts the c10d store
    local_addr: str  # how the other nodes reach this one
    join_timeout_s: float


def run_tag(job_id: str, attempt: int, node_rank: int = 0) -> str:
    """The tag of one node's processes of one attempt.

    NOTE: per node, not per attempt: two nodes of a gang may run on one machine (tests, a big box), and
    stopping one node must never find, by tag, the other node's processes.
    """
    return f"{job_id}.{attempt}" + (f".{node_rank}" if node_rank else "")


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
    scripts_dir: Path | None = None,
    entry_script: Path | None = None,
    gang: Gang | None = None,
    init_from: Path | None = None,
) -> Launch:
    """The command line; for an entrypoint job, `entry_script` is resolve_script()'s answer (script mode)."""
    nproc = spec.resources.nproc_per_node
    argv = [
        python, "-m", "torch.distributed.run",
        *(rendezvous_argv(gang, run_id=f"{job_id}-{attempt}") if gang else
          ["--standalone", "--nnodes", "1"]),
        "--nproc-per-node", str(nproc),
        "--max-restarts", "0",  # retries are the service's decision, with a new attempt
        "--log-dir", str(run_dir / "torchelastic"),  # per-rank error files land here (@record)
        *target_argv(spec, run_dir=run_dir, entry_script=entry_script),
    ]
    env = dict(base_env)
    env.update(spec.env)  # the job's own (JobSpec refuses the names below and those that change how we run)
    env.update({
        runenv.RUN_TAG_ENV: run_tag(job_id, attempt, gang.node_rank if gang else 0),
        runenv.JOB_ID_ENV: job_id,
        runenv.ATTEMPT_ENV: str(attempt),
        runenv.DATA_DIR_ENV: str(data_dir.resolve()),
        runenv.CHECKPOINT_DIR_ENV: str(job_dir / CHECKPOINTS),
        runenv.ARTIFACTS_DIR_ENV: str(job_dir / ARTIFACTS),
        runenv.METRICS_FILE_ENV: str(run_dir / runenv.METRICS_FILE),
        "TORCHELASTIC_ERROR_FILE": str(run_dir / "error.json"),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, int(shutdown_grace_s))),
        # torchrun leaves a torchelastic_* folder (and inductor caches) in TMPDIR: keep them in the run dir.
        "TMPDIR": str(run_dir / "tmp"),
        "PYTHONUNBUFFERED": "1",
    })
    if init_from is not None:
        env[runenv.INIT_FROM_ENV] = str(init_from)
    if spec.entrypoint is not None and scripts_dir is not None:
        # So `module` can live in the scripts dir, and a script can import its neighbours.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(scripts_dir), base_env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count // nproc)))
    return Launch(argv=argv, env=env)


def rendezvous_argv(gang: Gang, *, run_id: str) -> list[str]:
    """c10d dynamic rendezvous: node 0 hosts the store (is_host), and a node that never comes makes the others
    fail after join_timeout with RendezvousTimeoutError instead of waiting forever (static rendezvous would).

    NOTE: c10d numbers the nodes itself (sorted by address, then pid), so global rank 0 may run on any node:
    every node ships its own metrics file, and the one that has rank 0 carries the metrics and the summary.
    """
    conf = f"is_host={int(gang.node_rank == 0)},join_timeout={max(1, int(gang.join_timeout_s))}"
    return ["--nnodes", str(gang.nnodes), "--node-rank", str(gang.node_rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", gang.endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf,
            "--local-addr", gang.local_addr]


USER_MAIN = Path(__file__).resolve().with_name("user_main.py")


def target_argv(spec: JobSpec, *, run_dir: Path, entry_script: Path | None) -> list[str]:
    """What torchrun runs on every rank: the built-in runtime, or the user's module or script with its args
    (under worker/user_main.py, which runs it as Python would and exits without the teardown that aborts gloo).

    NOTE: user_main runs by its path, not as `-m worker.user_main`: a user's own `worker` module or package
    (first on the path, in their folder) would hide ours."""
    entry = spec.entrypoint
    if entry is None:
        return ["-m", "worker.train", str(run_dir)]
    if entry.module is not None:
        return [str(USER_MAIN), "module", entry.module, *entry.args]
    if entry_script is None:
        raise ValueError("an entrypoint script must be resolved (resolve_script) before it is rendered")
    return [str(USER_MAIN), "script", str(entry_script), *entry.args]


def check_entrypoint(spec: JobSpec, *, allowed: bool, scripts_dir: Path) -> Path | None:
    """Refuse an entrypoint job this worker may not run; returns the resolved script (None: not script mode)."""
    if spec.entrypoint is None:
        return None
    if not allowed:
        raise EntrypointRefused(ErrorType.ENTRYPOINT_DISABLED, "this worker does not run users' own code "
                                "(entrypoint jobs); start the worker with TRAINJOBS_ALLOW_ENTRYPOINTS=1 to allow them")
    if spec.entrypoint.script is None:
        return None  # a module is found by Python at launch; a missing one fails the run with its ImportError
    return resolve_script(scripts_dir, spec.entrypoint.script)


def resolve_script(scripts_dir: Path, script: str) -> Path:
    """The real path of `script` inside `scripts_dir`; never a path (or a symlink) that leaves it."""
    root = scripts_dir.resolve()
    relative = Path(script)
    if not script or "\0" in script or relative.is_absolute() or ".." in relative.parts:
        raise EntrypointRefused(ErrorType.INVALID_ENTRYPOINT, f"entrypoint.script {script!r} must be a relative path "
                                "inside the scripts directory (TRAINJOBS_SCRIPTS_DIR)")
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise EntrypointRefused(ErrorType.INVALID_ENTRYPOINT, f"entrypoint.script {script!r} points outside the "
                                "scripts directory (TRAINJOBS_SCRIPTS_DIR)")
    if not path.is_file():
        raise EntrypointRefused(ErrorType.ENTRYPOINT_NOT_FOUND, f"entrypoint.script {script!r} is not a file in the "
                                f"worker's scripts directory {root} (TRAINJOBS_SCRIPTS_DIR)")
    return path


def default_env() -> dict[str, str]:
    """The worker's environment, less what would confuse a nested torchrun and the service's own secrets."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in rank_env(os.environ).items() if k not in drop}
