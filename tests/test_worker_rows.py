"""A worker's row: registration from its flags, heartbeat, busy and draining states, and a lost member of a
forming gang (released, no retry spent); on both databases."""

from datetime import timedelta

from sqlalchemy import select, update

from service.cli import main as cli
from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.workers import service as workers
from service.workers.models import Worker
from tests.conftest import mlp_spec
from tests.helpers import wait_for
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import agent, gang, inventory
from worker.control import DatabaseControl


def test_trainjobs_worker_takes_slots_device_and_labels():
    args = cli.build_parser().parse_args(["worker", "--slots", "3", "--device", "cuda", "--label", "zone=a",
                                          "--label", "gpu=h100"])
    assert (args.slots, args.device, args.label) == (3, "cuda", ["zone=a", "gpu=h100"])


def test_flags_override_what_a_worker_detects(settings):
    flagged = settings.model_copy(update={"worker_slots": 3, "worker_device": "cpu", "worker_labels": "zone=a, rack=7",
                                          "worker_address": "10.1.2.3"})
    offer = inventory.probe(flagged, name="w", labels={"gpu": "none"})
    assert (offer.slots, offer.device, offer.address) == (3, "cpu", "10.1.2.3")
    assert offer.labels == {"zone": "a", "rack": "7", "gpu": "none"}


def test_a_worker_heartbeats_shows_busy_with_its_job_and_draining_when_shutting_down(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    draining = False
    offer = inventory.probe(settings.model_copy(update={"worker_slots": 2}), name="w1")
    stop = inventory.start_heartbeat(sessions, offer=offer, every_s=0.05, draining=lambda: draining)
    try:
        with sessions() as db:
            first = db.get(Worker, "w1").last_seen
            job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec()))
            workers.occupy(db, worker_id="w1", job_id=job.id, slots=2)
            db.commit()

        def seen(db) -> Worker:
            return db.scalars(select(Worker).where(Worker.id == "w1").execution_options(populate_existing=True)).one()

        with sessions() as db:
            wait_for(lambda: seen(db).last_seen > first, 5, interval=0.05, what="a heartbeat")
            row = seen(db)
            assert (row.state, row.current_job, row.busy_slots) == ("busy", job.id, 2)
            draining = True
            wait_for(lambda: seen(db).state == "draining", 5, interval=0.05, what="draining")
            workers.release(db, worker_id="w1", job_id=job.id)
            db.commit()
            assert (seen(db).state, seen(db).current_job, seen(db).busy_slots) == ("draining", None, 0)
            now = utcnow()
            assert workers.shown_state(seen(db), now=now, lost_after_s=10) == "draining"
            assert workers.shown_state(seen(db), now=now + timedelta(seconds=11), lost_after_s=10) == "lost"
    finally:
        stop()
    with sessions() as db:
        assert db.get(Worker, "w1") is None  # a clean stop removes the row
    engine.dispose()


def test_a_member_lost_while_its_gang_forms_releases_the_gang_without_spending_a_retry(settings, monkeypatch):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"}, max_retries=0)))
        db.commit()
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", "w0")
    agent.claim(DatabaseControl(sessions, settings), job_id=job.id)
    gang.join(DatabaseControl(sessions, settings), job_id=job.id, attempt=1, node_rank=1, worker="w1")
    with sessions() as db:
        expired = utcnow() - timedelta(seconds=1)  # node 1's worker died while the gang waited
        db.execute(update(Attempt).where(Attempt.node_rank == 1).values(lease_expires_at=expired))
        db.commit()
        assert lifecycle.expire_leases(db) == [job.id]
        row = db.scalars(select(Job).where(Job.id == job.id).execution_options(populate_existing=True)).one()
        assert row.status == JobStatus.QUEUED and "stopped renewing its lease" in row.pending_reason
        statuses = db.scalars(select(Attempt.status).where(Attempt.job_id == job.id)).all()
    assert statuses == ["preempted", "preempted"]  # max_retries 0, and still queued: it never ran
    engine.dispose()
