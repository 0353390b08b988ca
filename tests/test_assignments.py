"""One scheduler (issue 42, step 5): the control plane's pass plans the pool once, assigns each job it starts to a
worker and its devices, and moves the job's entry onto that worker's own queue; the worker takes what it is given
and only checks that it still fits. Real Redis, both databases (the concurrent passes: PostgreSQL).
"""

import logging
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.jobs import assigner, lifecycle, queue
from service.jobs import service as jobs
from service.jobs.models import Job
from service.scheduling.assignments import Assignment
from service.scheduling.placement import Device, machine_from_topo
from service.workers import holds
from service.workers import service as workers
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from trainjobs.spec import JobSpec
from worker import devices as worker_devices
from worker.control import DatabaseControl
from worker.dispatch import FittingQueue, Taker
from worker.inventory import Offer

TOPO = Path(__file__).parent / "fixtures" / "topo"
# Two sockets of four GPUs, PIX pairs (0-1, 2-3, 4-5, 6-7), NODE within a socket, SYS across.
PCIE = machine_from_topo("pcie", (TOPO / "pcie_4x4_dual_socket.txt").read_text(),
                         tuple(Device(i, f"GPU-{i:04x}") for i in range(8)))


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def gpu_worker(db, worker_id: str, *, gpus: int = 8, max_jobs: int = 8) -> None:
    machine = replace(PCIE, id=worker_id, devices=PCIE.devices[:gpus])
    workers.register(db, worker_id=worker_id, host=worker_id, address="10.0.0.1", device="cuda", slots=gpus,
                     memory_bytes=80 * 2**30, host_memory_bytes=2**40, labels={}, max_jobs=max_jobs,
                     devices=worker_devices.as_rows(machine))
    db.commit()


def queued(db, redis, name: str, gpus: int, **spec) -> str:
    """A job created and enqueued on its priority queue, as the API does."""
    job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
        name=name, resources={"nproc_per_node": gpus, "device": "cuda"}, **spec)))
    db.commit()
    queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job.id, priority=job.priority, timeout_s=job.spec.timeout_s)
    return job.id


def run_pass(settings, sessions, redis, **kw) -> assigner.Report:
    with sessions() as db:
        return assigner.run_pass(db, redis, settings, cache={}, **kw)


def own_queue(redis, worker_id: str) -> list[str]:
    return queue.worker_queue(redis, QUEUE_PREFIX, worker_id).get_job_ids()


def assignments(sessions) -> dict[str, tuple[str, list[int] | None]]:
    with sessions() as db:
        return {a.job_id: (a.worker_id, a.devices) for a in db.scalars(select(Assignment))}


def held_for(sessions, worker_id: str, job_id: str) -> list[int]:
    with sessions() as db:
        return sorted(d for d, (job, _) in holds.held(db, worker_id=worker_id).items() if job == job_id)


def test_one_pass_assigns_a_job_to_the_worker_the_plan_picks_on_the_devices_placement_picks(settings, sessions,
                                                                                           redis):
    with sessions() as db:
        gpu_worker(db, "big")
        gpu_worker(db, "pair", gpus=2, max_jobs=2)
        job = queued(db, redis, "two-gpus", 2)
    report = run_pass(settings, sessions, redis)
    # Best fit: the 2-GPU worker, not the 8-GPU one; there, its PIX pair.
    assert [(p.job_id, p.worker_id, p.devices) for p in report.assigned] == [(job, "pair", (0, 1))]
    assert assignments(sessions) == {job: ("pair", [0, 1])}
    assert held_for(sessions, "pair", job) == [0, 1]  # held now: the next pass sees them used
    assert own_queue(redis, "pair") == [job] and queued_ids(redis, QUEUE_PREFIX) == []
    with sessions() as db:
        assert db.get(Job, job).pending_reason is None


def test_a_job_that_does_not_fit_now_waits_on_its_queue_with_its_pending_reason(settings, sessions, redis):
    with sessions() as db:
        gpu_worker(db, "pair", gpus=2, max_jobs=2)
        first = queued(db, redis, "first", 2)
        second = queued(db, redis, "second", 2)
    report = run_pass(settings, sessions, redis)
    assert [p.job_id for p in report.assigned] == [first]
    assert queued_ids(redis, QUEUE_PREFIX) == [second] and own_queue(redis, "pair") == [first]
    run_pass(settings, sessions, redis)  # the next pass sees the first job's devices held: nothing more
    assert set(assignments(sessions)) == {first}
    with sessions() as db:
        why = db.get(Job, second).pending_reason
    assert why == "waiting for a free worker: 1 fit, 1 busy", why


def test_an_unclaimed_assignment_is_undone_after_two_passes_and_planned_again(settings, sessions, redis):
    with sessions() as db:
        gpu_worker(db, "w1", gpus=2, max_jobs=2)
        job = queued(db, redis, "job", 2)
    assert [p.worker_id for p in run_pass(settings, sessions, redis, unclaimed_s=0).assigned] == ["w1"]
    assert run_pass(settings, sessions, redis, unclaimed_s=0).undone == {}  # one pass: it stands
    third = run_pass(settings, sessions, redis, unclaimed_s=0)
    assert third.undone == {job: "unclaimed"}
    # Planned again in the same pass, on the only worker there is, its entry moved again (once).
    assert [p.worker_id for p in third.assigned] == ["w1"] and own_queue(redis, "w1") == [job]
    assert queued_ids(redis, QUEUE_PREFIX) == []
    assert held_for(sessions, "w1", job) == [0, 1]


def test_an_assignment_whose_worker_is_gone_goes_to_another_worker(settings, sessions, redis):
    with sessions() as db:
        gpu_worker(db, "w1", gpus=2, max_jobs=2)
        job = queued(db, redis, "job", 2)
    run_pass(settings, sessions, redis)
    with sessions() as db:
        workers.remove(db, worker_id="w1")  # it stopped (or its heartbeat went silent past the lease)
        db.commit()
        gpu_worker(db, "w2", gpus=2, max_jobs=2)
    report = run_pass(settings, sessions, redis)
    assert report.undone == {job: "lost"}
    assert [p.worker_id for p in report.assigned] == ["w2"] and assignments(sessions) == {job: ("w2", [0, 1])}
    assert own_queue(redis, "w1") == [] and own_queue(redis, "w2") == [job]
    assert held_for(sessions, "w1", job) == [] and held_for(sessions, "w2", job) == [0, 1]


def test_two_api_processes_passes_never_assign_one_job_twice(postgres_url, tmp_path, redis):
    from service.settings import Settings
    from tests.conftest import REDIS_URL

    settings = Settings(data_dir=tmp_path / "data", database_url=postgres_url, redis_url=REDIS_URL,
                        queue_prefix=QUEUE_PREFIX)
    engines = [make_engine(postgres_url) for _ in range(2)]
    makers = [make_sessionmaker(e) for e in engines]
    try:
        with makers[0]() as db:
            for w in ("a", "b", "c"):
                gpu_worker(db, w, gpus=2, max_jobs=2)
            ids = [queued(db, redis, f"j{i}", 1) for i in range(8)]
        barrier = threading.Barrier(2)
        reports: list[assigner.Report] = []

        def api_process(maker) -> None:  # two passes at once, as if the lock had been lost: the rows decide
            barrier.wait()
            with maker() as db:
                reports.append(assigner.run_pass(db, redis, settings, cache={}))

        threads = [threading.Thread(target=api_process, args=(m,)) for m in makers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        given = [p.job_id for r in reports for p in r.assigned]
        assert len(given) == len(set(given)) == 6  # three workers of two GPUs: six jobs, each once
        entries = [e for w in ("a", "b", "c") for e in own_queue(redis, w)]
        assert sorted(entries) == sorted(given) and set(given) <= set(ids)
        with makers[0]() as db:
            held = {w: holds.held(db, worker_id=w) for w in ("a", "b", "c")}
        assert sorted(job for h in held.values() for job, _ in h.values()) == sorted(given)
    finally:
        for e in engines:
            e.dispose()


@pytest.fixture
def lane(settings, sessions, redis, monkeypatch):
    """A lane of worker w1 (2 GPUs), dequeuing as worker/main.py's RQ loop does."""
    offer = Offer(id="w1", host="w1", address="10.0.0.1", device="cuda", slots=2, memory_bytes=80 * 2**30,
                  host_memory_bytes=2**40, max_jobs=2, machine=replace(PCIE, id="w1", devices=PCIE.devices[:2]))
    monkeypatch.setattr(FittingQueue, "taker", Taker(sessions, offer, settings,
                                                     control=DatabaseControl(sessions, settings)))
    queues = [FittingQueue(n, connection=redis, serializer=JSONSerializer, job_class=queue.GuardedJob)
              for n in (f"{QUEUE_PREFIX}-{queue.GANG}", queue.worker_queue_name(QUEUE_PREFIX, "w1"))]

    def dequeue():
        found = FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer,
                                         job_class=queue.GuardedJob)
        return found and found[0]

    with sessions() as db:
        gpu_worker(db, "w1", gpus=2, max_jobs=2)
    return dequeue


def test_a_worker_runs_what_it_is_assigned_and_a_cancelled_jobs_entry_is_removed_unrun(settings, sessions, redis,
                                                                                        lane):
    with sessions() as db:
        job = queued(db, redis, "job", 1)
        cancelled = queued(db, redis, "cancelled", 1)
    assert {p.job_id for p in run_pass(settings, sessions, redis).assigned} == {job, cancelled}
    with sessions() as db:
        lifecycle.request_cancel(db, job_id=cancelled)
    taken = [lane(), lane()]
    assert [t and t.id for t in taken] == [job, None]  # the cancelled one: removed, never run
    assert taken[0].origin == f"{QUEUE_PREFIX}-normal"  # its registries stay its priority queue's
    assert own_queue(redis, "w1") == [] and lane() is None


def test_an_assignment_whose_device_turned_unhealthy_is_given_back_and_planned_again(settings, sessions, redis,
                                                                                  lane):
    with sessions() as db:
        job = queued(db, redis, "job", 1)
    [placed] = run_pass(settings, sessions, redis).assigned
    with sessions() as db:  # its GPU fell off the bus, as the heartbeat reports it
        rows = workers.device_rows(db, worker_id="w1")
        rows[placed.devices[0]] = {**rows[placed.devices[0]], "healthy": False, "reason": "fell off the bus"}
        workers.beat(db, worker_id="w1", devices=rows)
        db.commit()
    assert lane() is None
    assert assignments(sessions) == {} and queued_ids(redis, QUEUE_PREFIX) == [job]
    [again] = run_pass(settings, sessions, redis).assigned
    assert again.devices != placed.devices and held_for(sessions, "w1", job) == list(again.devices)


def test_an_assignment_its_worker_took_stands_while_it_is_claimed_and_one_redis_lost_is_planned_again(
        settings, sessions, redis, lane):
    with sessions() as db:
        taken = queued(db, redis, "taken", 1)
    run_pass(settings, sessions, redis, unclaimed_s=0)
    assert lane().id == taken  # off its queue, still its to run: the claim comes next
    for _ in range(3):
        assert run_pass(settings, sessions, redis, unclaimed_s=0).undone == {}
    assert set(assignments(sessions)) == {taken}
    with sessions() as db:
        lost = queued(db, redis, "lost", 1)
    run_pass(settings, sessions, redis, unclaimed_s=0)
    redis.delete(queue.worker_queue(redis, QUEUE_PREFIX, "w1").key)  # the entry is gone with Redis's data
    reports = [run_pass(settings, sessions, redis, unclaimed_s=0) for _ in range(2)]
    assert reports[-1].undone == {lost: "unclaimed"}  # never taken: planned again, its entry anew
    assert [p.job_id for p in reports[-1].assigned] == [lost] and own_queue(redis, "w1") == [lost]


def test_a_forged_entry_on_a_workers_own_queue_is_refused_and_logged_never_run(settings, sessions, redis, lane,
                                                                              caplog, tmp_path):
    proof = tmp_path / "pwned"
    worker_queue = queue.worker_queue(redis, QUEUE_PREFIX, "w1")
    worker_queue.enqueue_call("os.system", args=[f"touch {proof}"], job_id="a1b2c3d4e5f6a7b8c9d0")
    with caplog.at_level(logging.ERROR, logger="worker.dispatch"):
        assert lane() is None
    assert not proof.exists() and not redis.exists(RQJob.key_for("a1b2c3d4e5f6a7b8c9d0"))
    assert "SECURITY" in caplog.text and "os.system" in caplog.text
    # A real job's entry, rewritten to run something else: refused, and its job is planned again, entry anew.
    with sessions() as db:
        job = queued(db, redis, "job", 1)
    run_pass(settings, sessions, redis)
    redis.hset(RQJob.key_for(job), "data", JSONSerializer.dumps(("os.system", None, ["true"], {})))
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="worker.dispatch"):
        assert lane() is None
    assert "SECURITY" in caplog.text
    assert assignments(sessions) == {} and queued_ids(redis, QUEUE_PREFIX) == [job]
    assert queue.refusal(queue.GuardedJob.fetch(job, connection=redis, serializer=JSONSerializer)) is None
