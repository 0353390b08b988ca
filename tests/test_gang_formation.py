"""How a gang forms, on both databases: joins are compare-and-sets, node 0 records the rendezvous, a gang that
does not form in time releases its nodes, and a younger half-formed gang yields to an older one."""

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import agent, gang
from worker.control import DatabaseControl
from worker.inventory import Offer

OFFER = Offer(id="w", host="h", address="127.0.0.1", device="cpu", slots=1, memory_bytes=2**34,
              host_memory_bytes=2**34)


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def claimed_gang(sessions, settings, monkeypatch, *, worker: str = "w0", nnodes: int = 2) -> str:
    """A gang job whose node 0 `worker` has claimed."""
    with sessions() as db:
        job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            resources={"nnodes": nnodes, "nproc_per_node": 1, "device": "cpu"})))
        db.commit()
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", worker)
    assert agent.claim(DatabaseControl(sessions, settings), job_id=job.id)[0] == 1
    return job.id


def look(sessions, settings, job_id: str, node_rank: int = 0) -> tuple[str | None, str]:
    with sessions() as db:
        got = lifecycle.check_gang(db, job_id=job_id, attempt=1, node_rank=node_rank, lease_s=settings.lease_s,
                                   gang_timeout_s=settings.gang_timeout_s, offer=OFFER, address="127.0.0.1")
        db.commit()
    return got


def test_a_gang_forms_once_every_node_joined_and_node_0_records_the_endpoint(sessions, settings, monkeypatch):
    job_id = claimed_gang(sessions, settings, monkeypatch)
    assert look(sessions, settings, job_id) == (None, "waiting")
    control = DatabaseControl(sessions, settings)
    assert gang.join(control, job_id=job_id, attempt=1, node_rank=1, worker="w1") is not None
    assert gang.join(control, job_id=job_id, attempt=1, node_rank=1, worker="w2") is None
    assert look(sessions, settings, job_id, node_rank=1) == (None, "waiting")  # only node 0 forms it
    endpoint, why = look(sessions, settings, job_id)
    assert why == "formed" and endpoint.startswith("127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    assert look(sessions, settings, job_id, node_rank=1) == (endpoint, "formed")
    with sessions() as db:
        assert db.get(Job, job_id).status == JobStatus.RUNNING
        nodes = db.execute(select(Attempt.node_rank, Attempt.worker).where(Attempt.job_id == job_id)).all()
    assert sorted(nodes) == [(0, "w0"), (1, "w1")]
    # a node task of an attempt gone by is skipped
    assert gang.join(control, job_id=job_id, attempt=1, node_rank=2, worker="w3") is None


def test_a_gang_not_formed_in_time_releases_its_nodes_and_is_queued_again(sessions, settings, monkeypatch):
    job_id = claimed_gang(sessions, settings, monkeypatch, nnodes=3)
    gang.join(DatabaseControl(sessions, settings), job_id=job_id, attempt=1, node_rank=1, worker="w1")
    with sessions() as db:
        db.execute(update(Job).where(Job.id == job_id).values(
            started_at=utcnow() - timedelta(seconds=settings.gang_timeout_s + 1)))
        db.commit()
    assert look(sessions, settings, job_id, node_rank=1) == (None, "timeout")
    assert look(sessions, settings, job_id) == (None, "lost")  # node 0 finds it gone and lets go too
    with sessions() as db:
        job = db.get(Job, job_id)
        assert job.status == JobStatus.QUEUED and "gang not formed" in job.pending_reason
        assert job.not_before <= utcnow()  # the sweeper enqueues it again at once
        statuses = db.scalars(select(Attempt.status).where(Attempt.job_id == job_id)).all()
    assert statuses == ["preempted", "preempted"]  # released, not failed: no retry spent


def test_a_younger_half_formed_gang_yields_to_an_older_one(sessions, settings, monkeypatch):
    older = claimed_gang(sessions, settings, monkeypatch, worker="w0")
    younger = claimed_gang(sessions, settings, monkeypatch, worker="w1")
    assert look(sessions, settings, older) == (None, "waiting")  # the older one never yields
    assert look(sessions, settings, younger) == (None, "yielded")
    with sessions() as db:
        assert db.get(Job, younger).status == JobStatus.QUEUED
        assert "older forming gang" in db.get(Job, younger).pending_reason
        assert db.get(Job, older).status == JobStatus.STARTING


def test_a_cancel_while_forming_cancels_every_node(sessions, settings, monkeypatch):
    job_id = claimed_gang(sessions, settings, monkeypatch)
    gang.join(DatabaseControl(sessions, settings), job_id=job_id, attempt=1, node_rank=1, worker="w1")
    with sessions() as db:
        lifecycle.request_cancel(db, job_id=job_id)
    assert look(sessions, settings, job_id, node_rank=1) == (None, "cancelled")
    with sessions() as db:
        assert db.get(Job, job_id).status == JobStatus.CANCELLED
        assert db.scalars(select(Attempt.status).where(Attempt.job_id == job_id)).all() == ["cancelled"] * 2


def test_a_worker_shutting_down_while_its_gang_forms_lets_the_gang_go(sessions, settings, monkeypatch):
    job_id = claimed_gang(sessions, settings, monkeypatch)
    got = gang.wait_formed(DatabaseControl(sessions, settings), settings=settings, job_id=job_id, attempt=1,
                           node_rank=0, offer=OFFER, address="127.0.0.1", stopping=lambda: True)
    assert got == (None, "preempted")
    with sessions() as db:
        job = db.get(Job, job_id)
        assert job.status == JobStatus.QUEUED and "shutting down" in job.pending_reason
