"""The retry rule and the sweeper, on both databases and the real Redis: no attempt is lost or run twice."""

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle, queue, retries
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from tests.conftest import QUEUE_PREFIX, mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import agent
from worker.control import DatabaseControl
from worker.supervisor import Outcome


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def running_job(sessions, settings, max_retries=1) -> str:
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(max_retries=max_retries))).id
        db.commit()
    claim(sessions, settings, job_id)
    return job_id


def claim(sessions, settings, job_id) -> int:
    attempt, _ = agent.claim(DatabaseControl(sessions, settings), job_id=job_id)
    with sessions() as db:
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=attempt)
        db.commit()
    return attempt


def record(sessions, settings, **outcome) -> None:
    """The worker's record of an attempt's end, as a database worker sends it (the protocol's `outcome`)."""
    agent.record(DatabaseControl(sessions, settings), **outcome)


def job_and_attempts(sessions, job_id):
    with sessions() as db:
        job = db.get(Job, job_id)
        attempts = db.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)).all()
        db.expunge_all()
        return job, attempts


def test_user_errors_are_final_and_infrastructure_errors_retried():
    assert not retries.is_retryable({"type": "ValueError", "message": "bad lr"}, [])
    assert not retries.is_retryable({"type": "timeout", "message": "past timeout_s"}, [])
    assert retries.is_retryable({"type": "process_exit", "message": "Signal 9"}, [])
    assert retries.is_retryable({"type": "RuntimeError", "message": "NCCL timeout"}, [])
    same = {"type": "RuntimeError", "message": "boom"}
    assert not retries.is_retryable(same, [same])  # the same error twice: the code, not the machine
    lost = {"type": "worker_lost", "message": "worker w stopped renewing its lease"}
    assert retries.is_retryable(lost, [lost])
    assert [retries.backoff_s(n) for n in (1, 2, 3, 10)] == [2, 4, 8, 60]


def test_a_failure_with_retries_left_requeues_after_a_backoff_then_fails_when_spent(sessions, settings, redis):
    job_id = running_job(sessions, settings, max_retries=1)
    crash = {"type": "process_exit", "message": "rank 1 got SIGKILL", "rank": 1}
    record(sessions, settings, job_id=job_id, attempt=1, outcome=Outcome(JobStatus.FAILED, -9, error=crash))
    job, attempts = job_and_attempts(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.not_before > utcnow()
    assert [a.status for a in attempts] == ["failed"] and attempts[0].exit_code == -9
    with sessions() as db:  # the backoff holds it back from the queue, and from a worker
        assert queue.reconcile(db, redis, prefix=QUEUE_PREFIX, min_age_s=0) == []
        assert agent.claim(DatabaseControl(sessions, settings), job_id=job_id) is None
        db.execute(update(Job).where(Job.id == job_id).values(not_before=utcnow() - timedelta(seconds=1)))
        db.commit()
        assert queue.reconcile(db, redis, prefix=QUEUE_PREFIX, min_age_s=None) == [job_id]

    assert claim(sessions, settings, job_id) == 2
    other = {"type": "process_exit", "message": "rank 0 got SIGKILL", "rank": 0}
    record(sessions, settings, job_id=job_id, attempt=2, outcome=Outcome(JobStatus.FAILED, -9, error=other))
    job, attempts = job_and_attempts(sessions, job_id)
    assert job.status == JobStatus.FAILED  # max_retries 1: two failures is the end
    assert [c["message"] for c in job.error["attempts"]] == ["rank 1 got SIGKILL", "rank 0 got SIGKILL"]


def test_a_job_handed_back_on_shutdown_spends_no_retry(sessions, settings):
    job_id = running_job(sessions, settings, max_retries=0)
    record(sessions, settings, job_id=job_id, attempt=1,
           outcome=Outcome(JobStatus.QUEUED, 0, detail="preempted by worker shutdown at step 7"))
    job, attempts = job_and_attempts(sessions, job_id)
    assert job.status == JobStatus.QUEUED and [a.status for a in attempts] == ["preempted"]
    claim(sessions, settings, job_id)
    crash = {"type": "process_exit", "message": "rank 0 got SIGKILL"}
    record(sessions, settings, job_id=job_id, attempt=2, outcome=Outcome(JobStatus.FAILED, -9, error=crash))
    assert job_and_attempts(sessions, job_id)[0].status == JobStatus.FAILED  # max_retries 0


def test_an_expired_lease_loses_the_attempt_and_fences_the_old_worker(sessions, settings):
    job_id = running_job(sessions, settings, max_retries=2)
    with sessions() as db:
        assert lifecycle.expire_leases(db) == []  # the lease is still good
        db.execute(update(Attempt).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        db.commit()
        assert lifecycle.expire_leases(db) == [job_id]
        assert lifecycle.expire_leases(db) == []  # settled once
    job, attempts = job_and_attempts(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.error["type"] == "worker_lost"
    assert attempts[0].status == "lost" and attempts[0].finished_at is not None

    assert claim(sessions, settings, job_id) == 2
    # The old worker wakes up and reports success: fenced, nothing changes.
    record(sessions, settings, job_id=job_id, attempt=1, outcome=Outcome(JobStatus.SUCCEEDED, 0, summary={"x": 1}))
    job, attempts = job_and_attempts(sessions, job_id)
    assert job.status == JobStatus.RUNNING and job.attempt == 2 and job.summary is None
    assert [a.status for a in attempts] == ["lost", "active"]


def test_attempts_are_listed_oldest_first(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec(max_retries=1)).json()["id"]
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    claim(sessions, settings, job_id)
    record(sessions, settings, job_id=job_id, attempt=1,
           outcome=Outcome(JobStatus.FAILED, 1, error={"type": "process_exit", "message": "x"}))
    engine.dispose()
    body = client.get(f"/v1/jobs/{job_id}/attempts").json()
    assert body["count"] == 1
    (first,) = body["data"]
    assert first["number"] == 1 and first["status"] == "failed" and first["error"]["message"] == "x"
    assert first["resumed_from_step"] is None and first["worker"]
    assert client.get("/v1/jobs/0123456789abcdef0123/attempts").status_code == 404


def test_a_database_blip_while_recording_is_retried_not_lost():
    from sqlalchemy.exc import OperationalError

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("UPDATE jobs", {}, Exception("server closed the connection unexpectedly"))
        return "recorded"

    assert agent.with_retries(flaky, what="record", first_s=0) == "recorded" and len(calls) == 3

    def down():
        raise OperationalError("UPDATE jobs", {}, Exception("connection refused"))

    with pytest.raises(OperationalError):  # a database gone for good still surfaces, after the tries
        agent.with_retries(down, what="record", tries=2, first_s=0)
