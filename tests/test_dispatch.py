"""A worker dequeues only what it fits: the unfit job stays on its queue for a worker that fits (real Redis)."""

from rq.serializers import JSONSerializer

from service.db import make_engine, make_sessionmaker
from service.jobs import queue
from service.jobs import service as jobs
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from trainjobs.spec import JobSpec
from worker.dispatch import Chooser, FittingQueue
from worker.inventory import Offer


def offer(slots: int, **labels: str) -> Offer:
    return Offer(id=f"w{slots}", host="h", address="127.0.0.1", device="cpu", slots=slots, memory_bytes=2**34,
                 host_memory_bytes=2**34, labels=labels)


def test_a_worker_takes_the_first_job_it_fits_and_leaves_the_others_queued(settings, redis, monkeypatch):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        big = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(resources={"nproc_per_node": 4})))
        zoned = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            resources={"nproc_per_node": 1, "selector": {"zone": "b"}})))
        small = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(resources={"nproc_per_node": 1})))
        db.commit()
    for job in (big, zoned, small):  # all on normal, the big one at the head
        queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job.id, priority="normal", timeout_s=60)
    queues = [FittingQueue(n, connection=redis, serializer=JSONSerializer) for n in queue.queue_names(QUEUE_PREFIX)]

    monkeypatch.setattr(FittingQueue, "chooser", Chooser(sessions, offer(1, zone="a"), settings))
    rq_job, _ = FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer)
    assert rq_job.id == small.id
    assert FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer) is None  # burst
    assert queued_ids(redis, QUEUE_PREFIX) == [big.id, zoned.id]  # still there, in order

    monkeypatch.setattr(FittingQueue, "chooser", Chooser(sessions, offer(4, zone="b"), settings))
    taken = [FittingQueue.dequeue_any(queues, 1, connection=redis, serializer=JSONSerializer)[0].id for _ in "ab"]
    assert taken == [big.id, zoned.id] and queued_ids(redis, QUEUE_PREFIX) == []
    engine.dispose()
