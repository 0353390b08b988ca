"""Tables of a job's life: the job, its attempts and its audit trail."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from service.db import Base, UTCDateTime, utcnow
from trainjobs.spec import JobSpec
from trainjobs.states import AttemptStatus


class SpecJSON(TypeDecorator):
    """A JobSpec stored as JSON and read back as a JobSpec: the spec keeps one shape from the API to the ranks.

    NOTE: a stored spec is validated on every read, so a change to JobSpec must keep old specs valid (new
    fields get defaults) or come with a migration that rewrites them.
    """

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return value.model_dump(mode="json") if isinstance(value, JobSpec) else value

    def process_result_value(self, value, dialect):
        return JobSpec.model_validate(value) if value is not None else None


UNCOLLECTED = "collected_at IS NULL AND finished_at IS NOT NULL"  # the jobs retention may still have to collect


class Job(Base):
    __tablename__ = "jobs"

    # Time-ordered ids (ms timestamp + random): newest-first keyset pagination is ORDER BY id.
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), default="admin")
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[JobSpec] = mapped_column(SpecJSON)
    spec_hash: Mapped[str] = mapped_column(String(64))  # of the spec as submitted: an idempotent retry's check
    status: Mapped[str] = mapped_column(String(16), index=True)
    priority: Mapped[str] = mapped_column(String(8))
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_retries: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    stacks_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # POST /v1/jobs/{id}/stacks
    # The scheduler asked this running job to hand its workers back to a higher-priority one (and which one).
    preempt_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    preempt_detail: Mapped[str | None] = mapped_column(Text)
    warnings: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))  # stragglers, ...
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime)  # a retry waits out its backoff
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # trainjobs/plan.py's Plan
    pending_reason: Mapped[str | None] = mapped_column(Text)  # why no worker takes it (the sweeper says)
    cloned_from: Mapped[str | None] = mapped_column(String(32))  # POST /v1/jobs/{id}/clone: the source job
    # A sweep's trial (POST /v1/sweeps): its sweep, its number there (unique: trial n is made once) and the
    # parameters it was given. reason: why it ended where status alone does not say (stopped_early).
    sweep_id: Mapped[str | None] = mapped_column(String(32))
    sweep_trial: Mapped[int | None] = mapped_column(Integer)
    sweep_params: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    reason: Mapped[str | None] = mapped_column(String(32))
    # Where its current attempt runs, a list of its nodes' shares: [{node_rank, worker, devices, uuids, cores, ...}]
    # (service/workers/holds.py bind; each attempt's own is in attempts.placement).
    placement: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    # When retention (service/jobs/retention.py) deleted all it deletes of the job: its rows, folder and stored
    # objects. A run looks only at old jobs without it, so a collected job costs a later run nothing.
    collected_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Bumped by the database on every UPDATE of the row (a trigger, migrations/versions/0011): a read's ETag.
    version: Mapped[int] = mapped_column(Integer, server_default="1")

    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        Index("ix_jobs_owner_id", "owner", "id"),  # a user's list, newest first
        Index("ix_jobs_owner_status_id", "owner", "status", "id"),  # ...of one status; their quota's count
        Index("ix_jobs_sweep_trial", "sweep_id", "sweep_trial", unique=True),  # ?sweep=, and trial n made once
        Index("ix_jobs_uncollected", "id", postgresql_where=text(UNCOLLECTED), sqlite_where=text(UNCOLLECTED)),
    )


class JobTag(Base):
    """One of a job's spec.tags: what the list's ?tag= filter reads (an index, not the spec's JSON)."""

    __tablename__ = "job_tags"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)

    __table_args__ = (Index("ix_job_tags_tag_job", "tag", "job_id"),)


class Attempt(Base):
    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(256))
    node_rank: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default=AttemptStatus.ACTIVE)  # trainjobs.states.AttemptStatus
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    resumed_from_step: Mapped[int | None] = mapped_column(Integer)  # None: it started from step 0
    endpoint: Mapped[str | None] = mapped_column(String(300))  # node 0 of a gang: its rendezvous host:port
    # The ranks' stacks, the latest dump (worker/stacks.py): {"reason", "taken_at", "ranks": [...]}
    stacks: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Where it runs on its worker: {"devices": [indices], "uuids": [...], "cores": [...]} (service/workers/holds.py)
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Its device-seconds are in its owner's usage (service/scheduling/service.py folds closed attempts in).
    charged: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))

    __table_args__ = (
        UniqueConstraint("job_id", "number", "node_rank", name="uq_attempts_job_number_node"),
        Index("ix_attempts_status_lease", "status", "lease_expires_at"),
        Index("ix_attempts_uncharged", "finished_at", postgresql_where=text("NOT charged"),
              sqlite_where=text("NOT charged")),
    )


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_job_events_job_time", "job_id", "time"),)


class JobCount(Base):
    """Jobs per status and priority, up to the last compaction (service/jobs/counts.py)."""

    __tablename__ = "job_counts"

    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    priority: Mapped[str] = mapped_column(String(8), primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)


class JobCountDelta(Base):
    """+1 / -1 per job row inserted, deleted or moved to another status or priority: written by triggers on
    jobs (migrations/versions/0012), appended only, so no two writers ever wait on one counter row."""

    __tablename__ = "job_count_deltas"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(String(16))
    priority: Mapped[str] = mapped_column(String(8))
    n: Mapped[int] = mapped_column(Integer)
