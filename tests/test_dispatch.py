"""A worker runs only what it fits: the scheduler's pass assigns each job to a worker that fits it, a job none fits
now stays on its priority queue, and each worker's lane takes what was assigned to it (real Redis)."""

from rq.serializers import JSONSerializer

from service.db import make_engine, make_sessionmaker
from service.jobs import assigner, queue
from service.jobs import service as jobs
from service.workers import service as workers
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from trainjobs.spec import JobSpec
from worker.control import DatabaseControl
from worker.dispatch import FittingQueue, Taker
from worker.inventory import Offer


def offer(slots: int, **labels: str) -> Offer:
    return Offer(id=f"w{slots}", host="h", address="127.0.0.1", device="cpu", slots=slots, memory_bytes=2**34,
                 host_memory_bytes=2**34, labels=labels)


def register(db, o: Offer) -> None:
    workers.register(db, worker_id=o.id, host=o.host, address=o.address, device=o.device, slots=o.slots,
                     memory_bytes=o.memory_bytes, host_memory_bytes=o.host_memory_bytes, labels=o.labels)


def test_each_worker_takes_a_job_it_fits_and_the_others_stay_queued(settings, redis, monkeypatch):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    small_worker, big_worker = offer(1, zone="a"), offer(4, zone="c")
    with sessions() as db:
        register(db, small_worker)
        register(db, big_worker)
        big = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(resources={"nproc_per_node": 4})))
        zoned = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            resources={"nproc_per_node": 1, "selector": {"zone": "b"}})))
        small = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(resources={"nproc_per_node": 1})))
        db.commit()
    for job in (big, zoned, small):  # all on normal, the big one at the head
        queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job.id, priority="normal", timeout_s=60)
    with sessions() as db:
        report = assigner.run_pass(db, redis, settings, cache={})
    assert {(p.job_id, p.worker_id) for p in report.assigned} == {(small.id, "w1"), (big.id, "w4")}
    assert queued_ids(redis, QUEUE_PREFIX) == [zoned.id]  # no live worker is in zone b: it stays, queued

    for worker, job in ((small_worker, small), (big_worker, big)):
        monkeypatch.setattr(FittingQueue, "taker", Taker(sessions, worker, settings,
                                                         control=DatabaseControl(sessions, settings)))
        queues = [FittingQueue(n, connection=redis, serializer=JSONSerializer)
                  for n in (f"{QUEUE_PREFIX}-{queue.GANG}", queue.worker_queue_name(QUEUE_PREFIX, worker.id))]
        rq_job, _ = FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer)
        assert rq_job.id == job.id
        assert FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer) is None  # burst
    assert queued_ids(redis, QUEUE_PREFIX) == [zoned.id]
    engine.dispose()
