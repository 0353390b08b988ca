"""Settings, read from the environment with the TRAINJOBS_ prefix."""

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything a process of trainjobs can be told from outside."""

    model_config = SettingsConfigDict(env_prefix="TRAINJOBS_", extra="ignore")

    data_dir: Path = Path("./trainjobs-data")
    database_url: str | None = None  # default: SQLite in data_dir
    storage_dir: Path | None = None  # checkpoints and artifacts, one folder per job; default: data_dir/storage
    scripts_dir: Path | None = None  # entrypoint scripts are resolved inside it; default: data_dir/scripts
    allow_entrypoints: bool = False  # a worker runs users' own code only when told to
    redis_url: str = "redis://127.0.0.1:6379/0"
    api_url: str = "http://127.0.0.1:8000"
    queue_prefix: str = "trainjobs"

    # Supervision of a running job (worker side).
    poll_s: float = Field(0.5, gt=0, description="how often the supervisor ships logs/metrics and checks cancel")
    cancel_grace_s: float = Field(10.0, ge=0, description="SIGTERM → SIGKILL grace period")
    preempt_grace_s: float = Field(60.0, ge=0, description="on worker shutdown, how long a job may take to "
                                   "checkpoint and exit before it is stopped hard")
    lease_s: float = Field(10.0, gt=0, description="how long an attempt's lease lasts without renewal")
    heartbeat_s: float = Field(2.0, gt=0, description="how often a running attempt renews its lease")
    log_max_bytes: int = Field(16 * 2**20, ge=1024, description="log bytes kept per job")
    # Sweeper inside the API: re-enqueues queued jobs that Redis lost.
    reconcile_s: float = Field(30.0, gt=0)
    # ... and finds expired leases (lost workers) and retries whose backoff is over, this often.
    sweep_s: float = Field(2.0, gt=0)

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


@lru_cache
def get_settings() -> Settings:
    return Settings()
