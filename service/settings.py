"""Settings, read from the environment with the TRAINJOBS_ prefix."""

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainjobs import paths


class Settings(BaseSettings):
    """Everything a process of trainjobs can be told from outside."""

    model_config = SettingsConfigDict(env_prefix="TRAINJOBS_", extra="ignore")

    data_dir: Path = Path("./trainjobs-data")
    database_url: str | None = None  # default: SQLite in data_dir
    storage_dir: Path | None = None  # checkpoints and artifacts, one folder per job; default: data_dir/storage
    # Object storage (service/storage/, worker/store_sync.py): with a store, storage_dir is each machine's own cache.
    storage_url: str | None = Field(None, description="s3://bucket/prefix (or file:///folder): where checkpoints "
                                    "and artifacts are kept, so workers need no shared filesystem (AWS_* variables "
                                    "for its endpoint and credentials); unset: storage_dir alone")
    store_timeout_s: float = Field(20.0, gt=0, description="one request to the store: connect and read timeout")
    store_wait_s: float = Field(300.0, ge=0, description="at an attempt's end, how long the worker retries storing "
                                "its last checkpoint and artifacts before the job fails naming the store")
    store_presigned_urls: bool = Field(False, description="an artifact download answers 307 to a presigned URL of "
                                       "the store (the client must reach it) instead of streaming through the API")
    store_presign_ttl_s: int = Field(300, ge=1, le=7 * 86400, description="how long a presigned URL is good")
    scripts_dir: Path | None = None  # entrypoint scripts are resolved inside it; default: data_dir/scripts
    allow_entrypoints: bool = False  # a worker runs users' own code only when told to
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis's password in a file of its own (a Docker secret, or the file `trainjobs up` writes in the secrets
    # dir): put into redis_url when that names none. Redis without one lets any process that reaches it (a job's
    # script) push queue entries; the API and workers say so at start (service/redis_auth.py).
    redis_password_file: Path | None = None
    api_url: str = "http://127.0.0.1:8000"
    # A worker that joins the pool through the API (issue 42): its registration and heartbeat go to this URL with
    # a worker credential of its own, got once for the join token (`trainjobs worker --api URL --join-token T`).
    worker_api: str | None = Field(None, description="the API a worker joins (every call it makes goes there, "
                                   "with a credential of its own); unset: refused unless TRAINJOBS_WORKER_DATABASE=1")
    worker_database: bool = Field(False, description="a worker with no API writes the database itself (its URL in "
                                  "its environment): only where it runs no one else's code; else refused")
    worker_join_token: str | None = Field(None, repr=False, description="the join token an admin made "
                                          "(`trainjobs worker-token create`), exchanged once for a credential")
    worker_credential_file: Path | None = Field(None, description="where a joined worker keeps its credential "
                                                "(0600); default: <secrets_dir>/worker-credential-<runner>.json")
    join_token_file: Path | None = Field(None, description="a file holding a join token (`tjj_` and 32+ characters) "
                                         "that the API accepts from its start and a worker sends when given no "
                                         "--join-token: how a compose file's workers join, as k3s's server token")
    token: str | None = Field(None, repr=False, description="the CLI's API token (else the admin token file)")
    # The service's own secrets (the admin token file): never inside a folder a job is handed (the data dir,
    # storage, scripts), so neither a link out of a job's folder nor a volume shared with workers reaches it.
    secrets_dir: Path | None = None  # default: data_dir's sibling <data_dir>-secrets; 0700, its files 0600
    queue_prefix: str = "trainjobs"

    # Who may call the API (service/auth/). Off only for one user on one machine: then it serves loopback only.
    auth: bool = Field(True, description="bearer tokens on every /v1 route; TRAINJOBS_AUTH=off for loopback only")
    max_body_bytes: int = Field(2**20, ge=1024, description="larger request bodies get a 413")
    worker_max_body_bytes: int = Field(2**25, ge=2**20, description="the same for the worker protocol's calls "
                                       "(/v1/worker/*): a worker's tick carries its attempts' batches")
    submit_rate_per_min: int = Field(60, ge=1, description="job submissions per token per minute, then 429")
    quota_active_jobs: int = Field(100, ge=1, description="queued + running jobs per owner, then 429")
    # Working-directory packages (service/packages/, trainjobs/packing.py).
    max_package_bytes: int = Field(100 * 2**20, ge=1024, description="a package's .tar.gz; larger is a 413")
    max_package_files: int = Field(10_000, ge=1, description="members of a package; more is a 422")
    max_package_unpacked_bytes: int = Field(500 * 2**20, ge=1024, description="a package unpacked; more is a 422")
    quota_package_bytes: int = Field(2**30, ge=1024, description="packages stored per owner, then 413")
    package_cache_bytes: int = Field(10 * 2**30, ge=0, description="a worker's unpacked packages, least "
                                     "recently used evicted past it")
    # A job's own dependencies (entrypoint.requirements, worker/environments.py).
    allow_pip: bool = Field(False, description="this worker builds a virtualenv for a job's requirements (it "
                            "also needs TRAINJOBS_ALLOW_ENTRYPOINTS)")
    pip_timeout_s: float = Field(1200.0, gt=0, description="installing one job's requirements; past it the job "
                                 "fails")
    env_cache_bytes: int = Field(20 * 2**30, ge=0, description="a worker's built environments, least recently "
                                 "used (and unused) evicted past it")
    allow_direct_urls: bool = Field(False, description="requirements may be direct references (name @ https://...):"
                                    " else a 422; even then fetched through the build's proxy, never from a private "
                                    "address")
    # Container images (spec.image, worker/images.py): pulled with skopeo, unpacked with umoci, cached per worker.
    image_cache_bytes: int = Field(50 * 2**30, ge=0, description="a worker's unpacked images (data_dir/image-cache), "
                                   "least recently used (and unused) evicted past it")
    image_pull_timeout_s: float = Field(1800.0, gt=0, description="pulling and unpacking one image; past it the "
                                        "job fails (image_unavailable)")
    image_insecure_registries: str = Field("", description="registries (host:port, comma-separated) pulled over "
                                           "plain HTTP or unverified TLS: only on loopback (127.0.0.1, localhost, "
                                           "::1), others are refused")
    pip_index_hosts: str = Field("", description="hosts (host or host:port, comma-separated) a build may reach "
                                 "besides its pip configuration's index and find-links hosts")

    # The sandbox around every attempt (worker/sandbox.py): auto = one where this machine can make it (bubblewrap);
    # required = refuse to start without one (and without a Redis password); off = none (the worker's labels say so).
    sandbox: Literal["auto", "required", "off"] = "auto"
    sandbox_uid_base: int = Field(200_000, ge=1000, description="a worker running as root runs each job as a uid "
                                  "of its own, base + a hash of the job id")
    sandbox_uid_count: int = Field(65_536, ge=1, description="how many uids from sandbox_uid_base jobs are given")
    job_network: bool = Field(False, description="single-node jobs may reach the network (else: loopback only; a "
                              "multi-node gang always shares the host's network)")
    multinode_for_all: bool = Field(False, description="every user may run a multi-node gang (nnodes > 1), whose "
                                    "ranks share their hosts' network; else only admins and users an admin granted "
                                    "it (trainjobs user set NAME --multinode)")
    job_env: str = Field("", description="the worker's own variables (names, or prefixes ending in *, comma-"
                         "separated) passed to jobs besides the basics; e.g. NCCL_*,HF_HOME")
    job_pids_max: int | None = Field(None, ge=16, description="processes and threads of one attempt (cgroup pids); "
                                     "default: a share of the host's kernel.pid_max and of the worker's cgroup's "
                                     "pids.max (docs/concepts/limits.md)")
    job_memory_bytes: int | None = Field(None, ge=2**24, description="memory of one attempt (cgroup); default: "
                                         "what the worker offers")

    # Supervision of a running job (worker side).
    poll_s: float = Field(0.5, gt=0, description="how often the supervisor ships logs/metrics and checks cancel")
    cancel_grace_s: float = Field(10.0, ge=0, description="SIGTERM → SIGKILL grace period")
    preempt_grace_s: float = Field(60.0, ge=0, description="on worker shutdown, how long a job may take to "
                                   "checkpoint and exit before it is stopped hard")
    lease_s: float = Field(10.0, gt=0, description="how long an attempt's lease lasts without renewal")
    heartbeat_s: float = Field(2.0, gt=0, description="how often a running attempt renews its lease")
    log_max_bytes: int = Field(16 * 2**20, ge=1024, description="log bytes kept per job")
    # What one job (one node of a gang) may store of metrics; past each cap the rest is counted, not stored, and the
    # job carries a note saying so (worker/shipping.py MetricTail). Never a failure.
    metric_max_points: int = Field(2_000_000, ge=1, description="metric points kept per job")
    metric_max_names: int = Field(1_000, ge=1, description="distinct metric names per job; new ones past it are "
                                  "refused")
    metric_name_max_chars: int = Field(64, ge=1, le=64, description="a metric name's length; longer ones are "
                                       "refused (64: the database's column)")
    metric_max_points_per_s: float = Field(20_000.0, ge=10, description="points shipped per second per job; a "
                                           "job that reports faster is thinned while it is behind")
    # Hang detection (a job's spec.hang overrides each): no new step (or, before the first, no new output)
    # for max(hang_min_s, hang_factor × the median step time) is a hang.
    hang_min_s: float = Field(300.0, gt=0)
    hang_factor: float = Field(10.0, ge=1)
    hang_startup_s: float = Field(600.0, gt=0, description="the bound before the ranks' first output or step")
    hang_action: Literal["retry", "fail", "report"] = "retry"
    # Stragglers (the built-in runtime's step_time_s/rank<r>; a job's spec.straggler overrides).
    straggler_factor: float = Field(1.3, gt=1)
    straggler_windows: int = Field(3, ge=1)
    # NOTE: 10 ms: a 2-rank toy job on a shared CPU (steps of a few ms, a descheduled rank a few ms late) was named
    # a straggler at 2 ms; a real one (steps of 100 ms and more, 30% slower) is tens of ms slower per step.
    straggler_min_excess_s: float = Field(0.01, ge=0, description="and at least this much slower per step than "
                                          "the others' median: jitter is no straggler")
    # Usage (worker/usage.py) and idle devices (a job's spec.idle overrides the last three).
    usage_sample_s: float = Field(5.0, ge=0, description="how often a supervisor samples its job's GPUs (or, on "
                                  "CPU, each rank's CPU use) into gpu_util, gpu_mem, cpu_util/rank<r>; 0: never "
                                  "(no usage series, no idle rule)")
    idle_min_util: float = Field(5.0, ge=0, le=100, description="percent of each GPU (on CPU: of one core per rank)")
    idle_window_s: float = Field(600.0, gt=0, description="below idle_min_util this long, all of it, is idle")
    idle_action: Literal["warn", "fail"] = "warn"
    # Sweeper inside the API: re-enqueues queued jobs that Redis lost.
    reconcile_s: float = Field(30.0, gt=0)
    # ... and finds expired leases (lost workers) and retries whose backoff is over, this often.
    sweep_s: float = Field(2.0, gt=0)
    # Retention (service/jobs/retention.py): off unless set; the sweeper then collects once an hour.
    retention_days: float | None = Field(None, gt=0, description="finished jobs' logs, metric points, events, "
                                         "folders and objects in the store are deleted this many days after they ended "
                                         "(rows stay)")

    # Webhooks (service/webhooks/): the API's delivery loop POSTs each outbox row, retrying with backoff.
    webhook_allow: str = Field("", description="hosts and CIDRs (comma-separated) a webhook may reach besides "
                               "public addresses, which are the only ones allowed by default")
    webhook_timeout_s: float = Field(5.0, gt=0, description="one POST, connect to last byte")
    webhook_concurrency: int = Field(8, ge=1, description="POSTs in flight per API process")
    webhook_poll_s: float = Field(1.0, gt=0, description="how often an idle delivery loop looks for due rows")
    webhook_backoff_s: float = Field(5.0, gt=0, description="the first retry's wait; doubled per failure")
    webhook_backoff_max_s: float = Field(3600.0, gt=0, description="the longest wait between two tries")
    webhook_give_up_s: float = Field(86400.0, gt=0, description="a delivery failing this long after its event is "
                                     "given up (shown as given_up in its deliveries)")
    webhook_keep_days: float = Field(7.0, gt=0, description="delivered and given-up rows are pruned after this")

    # Many machines (service/workers/, worker/gang.py).
    gang_timeout_s: float = Field(60.0, gt=0, description="a multi-node gang not formed by then goes back "
                                  "to the queue and releases its workers")
    aging_s: float = Field(600.0, gt=0, description="a job queued this long moves up one priority")
    # The fair pool (service/scheduling/policy.py).
    scheduler_policy: Literal["fair", "fifo"] = Field("fair", description="fair: fair share among jobs of one "
                                                      "priority; fifo: submission order")
    fair_share_half_life_s: float = Field(7 * 86400.0, gt=0, description="usage halves over this")
    preempt_after_s: float = Field(60.0, ge=0, description="a high job no free worker fits preempts lower ones "
                                   "after waiting this long")
    min_runtime_s: float = Field(600.0, ge=0, description="a job runs this long before it may be preempted")
    reserve_after_s: float = Field(300.0, ge=0, description="a job needing several workers reserves them after "
                                   "waiting this long")
    reserve_deadline_s: float = Field(48 * 3600.0, ge=0, description="a gang's reserved workers take a job of higher "
                                      "priority only if it ends before the gang's queued + reserve_after_s + this")
    max_reservations: int = Field(1, ge=1, description="gangs holding reservations at once, the oldest first (more "
                                  "bound more gangs' waits, and delay big one-node jobs)")
    nvlink_whole_jobs: bool = Field(True, description="a job whose node fills an NVLink island (8 GPUs where the "
                                    "largest is 8) waits for a worker with one rather than run across PCIe, while "
                                    "a live worker with one fits it; false: NVLink only orders the workers that fit")
    # What this worker offers, where detection is not what you want (`trainjobs worker --slots/--device/--label`).
    worker_slots: int | None = Field(None, ge=1, description="default: GPUs (cuda), else CPU cores")
    worker_device: Literal["cpu", "cuda"] | None = None  # default: cuda when nvidia-smi lists a GPU
    worker_max_jobs: int = Field(0, ge=0, description="jobs a worker runs at once, each on devices of its own "
                                 "(GPUs, or CPU slots); 0: one per slot, as many as fit")
    worker_labels: str = ""  # k=v,k2=v2: what a job's resources.selector matches
    worker_address: str | None = None  # how other nodes reach this one; default: the address that reaches Redis
    worker_min_free_bytes: int = Field(2**30, ge=0, description="free space the storage and run dirs keep; below "
                                       "it the worker takes no jobs (disk pressure) until space is back")

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'trainjobs.db').resolve()}"

    @property
    def resolved_storage_dir(self) -> Path:
        return (self.storage_dir or self.data_dir / "storage").resolve()

    @property
    def resolved_scripts_dir(self) -> Path:
        return (self.scripts_dir or self.data_dir / "scripts").resolve()

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"

    @property
    def service_paths(self) -> set[Path]:
        """The service's own files and folders, which no job is shown and no data.path names: the data dir's
        service entries, the SQLite file, the storage, runs and secrets dirs (resolved)."""
        data = self.data_dir.resolve()
        found = {data / name for name in paths.SERVICE_OWNED} | {self.resolved_storage_dir, self.runs_dir.resolve(),
                                                                 self.resolved_secrets_dir}
        if self.resolved_database_url.startswith("sqlite:///"):
            found.add(Path(self.resolved_database_url.removeprefix("sqlite:///")).resolve())
        return found

    @property
    def resolved_secrets_dir(self) -> Path:
        if self.secrets_dir:
            return self.secrets_dir.resolve()
        data_dir = self.data_dir.resolve()
        return data_dir.with_name(f"{data_dir.name}-secrets")

    @property
    def admin_token_file(self) -> Path:
        """Where the first admin token is written (by the API or `trainjobs up`) and the CLI finds it."""
        return self.resolved_secrets_dir / "admin.token"

    @model_validator(mode="after")
    def _redis_password_from_file(self) -> "Settings":
        if self.redis_password_file is not None:
            from service.redis_auth import with_password  # light: urllib only

            password = self.redis_password_file.read_text().strip()
            self.redis_url = with_password(self.redis_url, password)
        return self

    @model_validator(mode="after")
    def _secrets_apart_from_jobs(self) -> "Settings":
        secrets = self.resolved_secrets_dir
        for name, folder in (("TRAINJOBS_DATA_DIR", self.data_dir.resolve()), ("TRAINJOBS_STORAGE_DIR",
                             self.resolved_storage_dir), ("TRAINJOBS_SCRIPTS_DIR", self.resolved_scripts_dir)):
            if secrets.is_relative_to(folder):
                raise ValueError(f"TRAINJOBS_SECRETS_DIR ({secrets}) is inside {name} ({folder}), which jobs are "
                                 "handed; put the service's secrets elsewhere")
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: what auth off may serve."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings, host: str) -> None:
    """Auth off is for one user on one machine: refuse to serve it on anything but loopback."""
    if not settings.auth and not is_loopback(host):
        raise SystemExit(f"TRAINJOBS_AUTH=off serves loopback only; refusing to listen on {host} "
                         "(bind 127.0.0.1, or turn auth on and use tokens)")
