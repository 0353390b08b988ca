"""Why a queued job waits (pending_reason), what fits where, and priority aging, on both databases."""

from datetime import timedelta

from sqlalchemy import select, update

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import pending, queue
from service.jobs import service as jobs
from service.jobs.models import Job, JobEvent
from service.scheduling import service as scheduling
from service.workers import fit
from service.workers import service as workers
from service.workers.models import Worker
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from trainjobs.spec import JobSpec


def add_worker(db, name: str, *, slots: int = 1, device: str = "cpu", labels: dict | None = None,
               memory_gib: float = 16) -> None:
    workers.register(db, worker_id=name, host="h", address="10.0.0.1", device=device, slots=slots,
                     memory_bytes=int(memory_gib * 2**30), host_memory_bytes=int(memory_gib * 2**30),
                     labels=labels or {})


def submit(db, **overrides) -> Job:
    job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(**overrides)))
    db.commit()
    return job


def test_a_worker_fits_a_job_on_device_slots_memory_and_labels():
    need = fit.Need(device="cuda", slots=2, memory_bytes=40 * 2**30, memory_device="cuda", labels={"zone": "a"})

    class W:
        id, device, slots, memory_bytes, labels = "w", "cuda", 4, 80 * 2**30, {"zone": "a", "rack": "1"}

    assert fit.misfit(need, W) is None
    for attr, value, why in (("device", "cpu", "device cpu, needs cuda"), ("slots", 1, "1 slot(s), needs 2"),
                             ("memory_bytes", 24 * 2**30, "24.0 GiB per device, needs 40.0 GiB"),
                             ("labels", {"zone": "b"}, "lacks label(s) zone=a")):
        other = type("Other", (W,), {attr: value})
        assert fit.misfit(need, other) == why


def test_a_job_with_requirements_fits_only_a_worker_that_installs_them():
    spec = JobSpec.model_validate({"entrypoint": {"script": "t.py", "requirements": ["tomli-w==1.0.0"]}})
    need = fit.need_of(spec, None)

    class Closed:
        id, device, slots, memory_bytes, labels = "closed", "cpu", 2, 2**34, {"zone": "a"}

    class Plain(Closed):
        id, labels = "plain", {fit.ENTRYPOINTS_LABEL: "true"}

    class Pip(Plain):
        id, labels = "pip", {fit.ENTRYPOINTS_LABEL: "true", fit.PIP_LABEL: "true"}

    assert need.pip and fit.misfit(need, Pip) is None
    assert fit.misfit(need, Plain) == "does not install requirements (TRAINJOBS_ALLOW_PIP)"
    assert fit.misfit(need, Closed) == "does not run users' own code (TRAINJOBS_ALLOW_ENTRYPOINTS)"
    assert fit.pending_reason(need, [Plain]) == "no live worker fits (plain: does not install requirements " \
        "(TRAINJOBS_ALLOW_PIP))"
    assert not fit.need_of(JobSpec.model_validate({"entrypoint": {"script": "t.py"}}), None).pip


def test_pending_reason_says_why_no_live_worker_takes_a_job(settings):
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        four = submit(db, resources={"nproc_per_node": 4, "device": "cpu"})
        zoned = submit(db, resources={"nproc_per_node": 1, "device": "cpu", "selector": {"zone": "b"}})
        gang = submit(db, resources={"nnodes": 3, "nproc_per_node": 1, "device": "cpu"})
        ok = submit(db, resources={"nproc_per_node": 1, "device": "cpu"})
        pending.explain(db, settings)
        db.commit()
        db.refresh(four)
        assert four.pending_reason == "no live worker"
        add_worker(db, "w1", labels={"zone": "a"})
        add_worker(db, "w2", labels={"zone": "a"})
        db.commit()
        pending.explain(db, settings)
        db.commit()
        for job in (four, zoned, gang, ok):
            db.refresh(job)
        assert four.pending_reason == "no live worker fits (w1: 1 slot(s), needs 4; w2: 1 slot(s), needs 4)"
        assert zoned.pending_reason.startswith("no live worker fits (w1: lacks label(s) zone=b")
        assert gang.pending_reason == "needs 3 nodes that fit, 2 live worker(s) do (1 more needed: one node per worker)"
        assert ok.pending_reason is None  # a free worker fits: it is about to run
        db.execute(update(Worker).where(Worker.id == "w1").values(
            last_seen=utcnow() - timedelta(seconds=settings.lease_s + 1)))  # w1 is lost: it no longer counts
        workers.occupy(db, worker_id="w2", job_id=four.id, slots=1)
        db.commit()
        pending.explain(db, settings)
        db.commit()
        db.refresh(ok)
        assert ok.pending_reason == "waiting for a free worker: 1 fit, 1 busy"
    engine.dispose()


def test_a_job_waiting_past_the_aging_time_moves_up_one_priority(settings, redis):
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        low = submit(db, priority="low")
        fresh = submit(db, priority="low")
        for job in (low, fresh):
            queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job.id, priority="low", timeout_s=60)
        db.execute(update(Job).where(Job.id == low.id).values(queued_at=utcnow() - timedelta(seconds=11)))
        db.commit()
        assert pending.age(db, redis, prefix=QUEUE_PREFIX, aging_s=10) == [low.id]
        db.refresh(low)
        db.refresh(fresh)
        assert (low.priority, fresh.priority) == ("normal", "low")
        assert queue.get_queue(redis, QUEUE_PREFIX, "normal").get_job_ids() == [low.id]
        assert sorted(queued_ids(redis, QUEUE_PREFIX)) == sorted([low.id, fresh.id])  # moved, not copied
        assert pending.age(db, redis, prefix=QUEUE_PREFIX, aging_s=10) == []  # its wait restarted at normal
        db.execute(update(Job).where(Job.id == low.id).values(queued_at=utcnow() - timedelta(seconds=11)))
        db.commit()
        assert pending.age(db, redis, prefix=QUEUE_PREFIX, aging_s=10) == [low.id]
        db.refresh(low)
        assert low.priority == "high"
        assert pending.age(db, redis, prefix=QUEUE_PREFIX, aging_s=0.001) == [fresh.id]  # high is the top
        aged = db.scalars(select(JobEvent.detail).where(JobEvent.job_id == low.id, JobEvent.kind == "aged")
                          .order_by(JobEvent.id)).all()
        assert aged == ["waited over 10s: priority low → normal", "waited over 10s: priority normal → high"]
    engine.dispose()


def test_the_sweepers_passes_read_a_queued_jobs_spec_once(settings, monkeypatch):
    engine = make_engine(settings.resolved_database_url)
    parsed = []
    real = scheduling.req_of
    monkeypatch.setattr(scheduling, "req_of", lambda spec, plan: parsed.append(spec.name) or real(spec, plan))
    cache: dict = {}
    with make_sessionmaker(engine)() as db:
        for name in ("a", "b"):
            submit(db, name=name)
        pending.explain(db, settings, cache=cache)
        pending.explain(db, settings, cache=cache)
        submit(db, name="c")
        plan = pending.explain(db, settings, cache=cache)
    engine.dispose()
    assert sorted(parsed) == ["a", "b", "c"]  # each once, across three passes
    assert [p.reason for p in plan.order] == ["no live worker"] * 3
