"""The worker's claim is a compare-and-set: a job that reaches workers twice runs once."""

from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import agent
from worker.control import DatabaseControl
from worker.supervisor import Outcome


def new_job(sessions) -> str:
    with sessions() as db:
        job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec()))
        db.commit()
        return job.id


def test_second_claim_of_the_same_job_by_another_worker_gets_nothing(settings, monkeypatch):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    control = DatabaseControl(sessions, settings)
    job_id = new_job(sessions)
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", "w1")
    first = agent.claim(control, job_id=job_id)
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", "w2")
    second = agent.claim(control, job_id=job_id)
    assert first is not None and first[0] == 1 and second is None
    with sessions() as db:
        job = db.get(Job, job_id)
        assert job.status == JobStatus.STARTING and job.attempt == 1
        attempts = db.scalars(select(Attempt).where(Attempt.job_id == job_id)).all()
        assert len(attempts) == 1 and attempts[0].lease_expires_at is not None
    engine.dispose()


def test_claim_of_a_job_cancelled_in_the_race_cancels_it(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    control = DatabaseControl(sessions, settings)
    job_id = new_job(sessions)
    with sessions() as db:  # a cancel that lost its own race with... nothing: flag set, still queued
        db.get(Job, job_id).cancel_requested_at = jobs.utcnow()
        db.commit()
    assert agent.claim(control, job_id=job_id) is None
    with sessions() as db:
        assert db.get(Job, job_id).status == JobStatus.CANCELLED
    engine.dispose()


def test_outcome_of_a_stale_attempt_is_not_recorded(settings):
    """Fencing: an attempt that no longer holds the job cannot write its status."""
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    control = DatabaseControl(sessions, settings)
    job_id = new_job(sessions)
    agent.claim(control, job_id=job_id)
    with sessions() as db:
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=1)
        db.commit()
    agent.record(control, job_id=job_id, attempt=7, outcome=Outcome(JobStatus.SUCCEEDED, 0, summary={}))
    with sessions() as db:
        assert db.get(Job, job_id).status == JobStatus.RUNNING
    agent.record(control, job_id=job_id, attempt=1, outcome=Outcome(JobStatus.SUCCEEDED, 0, summary={"x": 1}))
    with sessions() as db:
        job = db.get(Job, job_id)
        assert job.status == JobStatus.SUCCEEDED and job.summary == {"x": 1} and job.finished_at is not None
    engine.dispose()


def test_terminal_states_never_change(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    job_id = new_job(sessions)
    with sessions() as db:
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.CANCELLED)
        db.commit()
        for status in JobStatus:
            assert not lifecycle.transition(db, job_id=job_id, to=status)
    engine.dispose()


def test_a_claim_that_would_put_a_team_over_its_quota_leaves_the_job_queued_and_back_on_its_queue(settings, redis):
    """The claim is the quota's fence: two workers that planned at one instant both saw the quota free."""
    from service.auth.models import User
    from service.jobs import queue
    from service.scheduling.models import Team

    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    control = DatabaseControl(sessions, settings)
    with sessions() as db:
        db.add(Team(name="vision", weight=1.0, max_slots=2))
        db.add(User(name="vera", team="vision"))
        db.add(User(name="vic", team="vision"))
        first = jobs.create(db, spec=JobSpec.model_validate(mlp_spec()), owner="vera").id  # 2 slots
        second = jobs.create(db, spec=JobSpec.model_validate(mlp_spec()), owner="vic").id
        db.commit()
    assert agent.claim(control, job_id=first) is not None
    assert agent.claim(control, job_id=second) is None  # 2 + 2 > 2: not now
    with sessions() as db:
        assert db.get(Job, second).status == JobStatus.QUEUED
    waiting = [i.decode() for i in redis.lrange(queue.get_queue(redis, settings.queue_prefix, "normal").key, 0, -1)]
    assert second in waiting  # back on its queue for the next plan, which keeps it waiting for the quota
    with sessions() as db:  # the first ends: the second may run
        lifecycle.transition(db, job_id=first, to=JobStatus.RUNNING)
        lifecycle.transition(db, job_id=first, to=JobStatus.SUCCEEDED)
        db.commit()
    assert agent.claim(control, job_id=second) is not None
    engine.dispose()
