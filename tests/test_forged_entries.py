"""A queue entry the service never wrote is removed and logged, never run; a stale one is removed, never run.

The entries are pushed as an attacker with Redis access would, on the queues a worker reads (the gang's node
tasks and its own queue, where the scheduler puts what it assigns): RQ's own enqueue (any dotted function name),
and a real job's id with a function, arguments or callbacks of the attacker's choosing (real Redis, real dequeue).
"""

import logging

import pytest
from rq.job import Job as RQJob
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

OFFER = Offer(id="w1", host="h", address="127.0.0.1", device="cpu", slots=4, memory_bytes=2**34,
              host_memory_bytes=2**34, labels={})


@pytest.fixture
def dispatch(settings, redis, monkeypatch):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    monkeypatch.setattr(FittingQueue, "taker", Taker(sessions, OFFER, settings,
                                                     control=DatabaseControl(sessions, settings)))
    queues = [FittingQueue(n, connection=redis, serializer=JSONSerializer, job_class=queue.GuardedJob)
              for n in (f"{QUEUE_PREFIX}-{queue.GANG}", queue.worker_queue_name(QUEUE_PREFIX, OFFER.id))]
    with sessions() as db:
        workers.register(db, worker_id=OFFER.id, host=OFFER.host, address=OFFER.address, device=OFFER.device,
                         slots=OFFER.slots, memory_bytes=OFFER.memory_bytes,
                         host_memory_bytes=OFFER.host_memory_bytes, labels={})
        db.commit()

    def dequeue():
        found = FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer,
                                         job_class=queue.GuardedJob)
        return found and found[0]

    yield sessions, dequeue
    engine.dispose()


def queued_job(sessions) -> str:
    with sessions() as db:
        job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec()))
        db.commit()
        return job.id


OWN = f"w-{OFFER.id}"  # the worker's own queue, `<prefix>-w-<worker id>`


def push(redis, name: str, func: str, args: list, job_id: str, **kwargs) -> None:
    queue.get_queue(redis, QUEUE_PREFIX, name).enqueue_call(func, args=args, job_id=job_id, **kwargs)


def own_ids(redis) -> list[str]:
    return queue.worker_queue(redis, QUEUE_PREFIX, OFFER.id).get_job_ids()


@pytest.mark.parametrize("name", [queue.GANG, OWN])
def test_an_entry_calling_os_system_is_removed_and_logged_never_run(dispatch, redis, caplog, tmp_path, name):
    sessions, dequeue = dispatch
    proof = tmp_path / "pwned"
    push(redis, name, "os.system", [f"touch {proof}"], "a1b2c3d4e5f6a7b8c9d0")
    with caplog.at_level(logging.ERROR, logger="worker.dispatch"):
        assert dequeue() is None
    assert not proof.exists()
    assert queued_ids(redis, QUEUE_PREFIX) == [] and not redis.exists(RQJob.key_for("a1b2c3d4e5f6a7b8c9d0"))
    assert own_ids(redis) == [] and "SECURITY" in caplog.text and "os.system" in caplog.text


@pytest.mark.parametrize(("func", "args", "extra", "says"), [
    (queue.JOB_FUNCTION, ["other-id"], {}, "names job"),
    (queue.JOB_FUNCTION, [], {"kwargs": {"job_id": "x"}}, "arguments"),
    (queue.JOB_FUNCTION, [1], {}, "arguments"),
    (queue.JOB_FUNCTION, None, {"on_success": "os.getcwd"}, "callbacks"),
])
def test_a_real_jobs_id_with_forged_arguments_or_callbacks_is_refused(dispatch, redis, caplog, func, args, extra,
                                                                      says):
    sessions, dequeue = dispatch
    job_id = queued_job(sessions)
    from rq import Callback

    if "on_success" in extra:
        extra = {"on_success": Callback(extra["on_success"])}
    push(redis, OWN, func, [job_id] if args is None else args, job_id, **extra)
    with caplog.at_level(logging.ERROR, logger="worker.dispatch"):
        assert dequeue() is None
    assert says in caplog.text and "SECURITY" in caplog.text
    assert queued_ids(redis, QUEUE_PREFIX) == [] and own_ids(redis) == []


def test_the_services_own_entry_is_taken_and_a_stale_one_removed_unrun(dispatch, settings, redis, caplog):
    sessions, dequeue = dispatch
    job_id = queued_job(sessions)
    push(redis, OWN, queue.JOB_FUNCTION, ["0" * 20], "0" * 20)  # no such job, yet the service's function
    queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job_id, priority="normal", timeout_s=60)
    with sessions() as db:  # the scheduler's pass moves it onto this worker's queue
        assert [p.job_id for p in assigner.run_pass(db, redis, settings, cache={}).assigned] == [job_id]
    taken = dequeue()
    assert taken.id == job_id and taken.func_name == queue.JOB_FUNCTION
    assert queued_ids(redis, QUEUE_PREFIX) == [] and own_ids(redis) == []
    assert not redis.exists(RQJob.key_for("0" * 20))
    assert "SECURITY" not in caplog.text


def test_a_hash_rewritten_after_the_check_is_still_refused_when_rq_reaches_for_its_function(redis):
    push(redis, "normal", queue.JOB_FUNCTION, ["abc"], "abc")
    job = queue.GuardedJob.fetch("abc", connection=redis, serializer=JSONSerializer)
    assert job.func.__name__ == "run_job"
    redis.hset(job.key, "data", JSONSerializer.dumps(("os.system", None, ["true"], {})))
    job.refresh()
    with pytest.raises(PermissionError, match="SECURITY"):
        _ = job.func
