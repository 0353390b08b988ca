"""One scheduler for a gang (issue 42): one pass assigns every node of a gang to a worker and its devices, in one
transaction; once node 0 claims the job, each other node's task lands on its own worker's queue, which runs it
after the `assignment` call says it still holds; a node undone undoes the whole gang. Real Redis, both databases.
"""

from dataclasses import replace

import pytest
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.jobs import assigner, queue
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.scheduling.assignments import Assignment
from service.workers import holds
from service.workers import service as workers
from tests.conftest import QUEUE_PREFIX, mlp_spec
from tests.helpers import queued_ids
from tests.test_assignments import PCIE, gpu_worker
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker import agent, gang
from worker.control import DatabaseControl, Refused
from worker.dispatch import FittingQueue, Taker
from worker.inventory import Offer


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def queued_gang(db, redis, gpus: int = 2, nnodes: int = 2) -> str:
    job = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
        name="gang", resources={"nnodes": nnodes, "nproc_per_node": gpus, "device": "cuda"})))
    db.commit()
    queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=job.id, priority=job.priority, timeout_s=job.spec.timeout_s)
    return job.id


def run_pass(settings, sessions, redis, **kw) -> assigner.Report:
    with sessions() as db:
        return assigner.run_pass(db, redis, settings, cache={}, **kw)


def rows(sessions) -> dict[int, tuple[str, list[int] | None]]:
    with sessions() as db:
        return {a.node_rank: (a.worker_id, a.devices) for a in db.scalars(select(Assignment))}


def held(sessions, job_id: str) -> dict[str, list[tuple[int, int]]]:
    """worker -> (device, node) held for the job."""
    with sessions() as db:
        out = {w: sorted((d, node) for d, (j, node) in holds.held(db, worker_id=w).items() if j == job_id)
               for w in ("a", "b", "c")}
    return {w: h for w, h in out.items() if h}


def own_queue(redis, worker_id: str) -> list[str]:
    return queue.worker_queue(redis, QUEUE_PREFIX, worker_id).get_job_ids()


def dequeue(sessions, settings, redis, monkeypatch, worker_id: str):
    """One lane of `worker_id` (2 GPUs) taking what is on its own queue, as worker/main.py's RQ loop does."""
    offer = Offer(id=worker_id, host=worker_id, address="10.0.0.1", device="cuda", slots=2, memory_bytes=80 * 2**30,
                  host_memory_bytes=2**40, max_jobs=2, machine=replace(PCIE, id=worker_id, devices=PCIE.devices[:2]))
    monkeypatch.setattr(FittingQueue, "taker", Taker(sessions, offer, settings,
                                                     control=DatabaseControl(sessions, settings)))
    queues = [FittingQueue(queue.worker_queue_name(QUEUE_PREFIX, worker_id), connection=redis,
                           serializer=JSONSerializer, job_class=queue.GuardedJob)]
    found = FittingQueue.dequeue_any(queues, None, connection=redis, serializer=JSONSerializer,
                                     job_class=queue.GuardedJob)
    return found and found[0]


@pytest.fixture
def pool(sessions):
    with sessions() as db:
        for w in ("a", "b"):
            gpu_worker(db, w, gpus=2, max_jobs=2)


def claim_node_0(sessions, settings, monkeypatch, job_id: str, worker_id: str) -> int:
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", worker_id)
    attempt, _ = agent.claim(DatabaseControl(sessions, settings), job_id=job_id)
    return attempt


def test_one_pass_assigns_both_nodes_of_a_gang_to_two_workers_and_node_1_runs_where_it_is_assigned(
        settings, sessions, redis, pool, monkeypatch):
    with sessions() as db:
        job = queued_gang(db, redis)
    report = run_pass(settings, sessions, redis)
    # One pass, one transaction: node 0 and node 1 each on a worker of its own, on that worker's devices.
    [first], [second] = report.assigned, report.nodes
    assert (first.job_id, first.node_rank, second.job_id, second.node_rank) == (job, 0, job, 1)
    assert {first.worker_id, second.worker_id} == {"a", "b"}
    assert rows(sessions) == {0: (first.worker_id, [0, 1]), 1: (second.worker_id, [0, 1])}
    assert held(sessions, job) == {first.worker_id: [(0, 0), (1, 0)], second.worker_id: [(0, 1), (1, 1)]}
    # The job's entry goes to node 0's worker; node 1 waits for node 0's claim (its task names that attempt).
    assert own_queue(redis, first.worker_id) == [job] and own_queue(redis, second.worker_id) == []
    assert queued_ids(redis, QUEUE_PREFIX) == []

    assert dequeue(sessions, settings, redis, monkeypatch, first.worker_id).id == job
    attempt = claim_node_0(sessions, settings, monkeypatch, job, first.worker_id)
    after_claim = run_pass(settings, sessions, redis)  # the claim kicked it
    task = queue.node_task_id(job, attempt, 1)
    assert after_claim.handed == [task] and after_claim.undone == {}
    assert own_queue(redis, second.worker_id) == [task] and own_queue(redis, first.worker_id) == []
    taken = dequeue(sessions, settings, redis, monkeypatch, second.worker_id)
    assert (taken.func_name, taken.args) == (queue.NODE_FUNCTION, [job, attempt, 1])
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", second.worker_id)
    spec = gang.join(DatabaseControl(sessions, settings), job_id=job, attempt=attempt, node_rank=1,
                     worker=second.worker_id)
    assert spec is not None and spec.resources.nnodes == 2
    # Joined: its assignment is done; its devices stay held for its attempt. Nothing is handed twice.
    later = run_pass(settings, sessions, redis)
    assert later.handed == [] and later.undone == {} and rows(sessions) == {}
    assert held(sessions, job)[second.worker_id] == [(0, 1), (1, 1)]
    with sessions() as db:
        nodes = db.execute(select(Attempt.node_rank, Attempt.worker).where(Attempt.job_id == job)).all()
    assert sorted(nodes) == [(0, first.worker_id), (1, second.worker_id)]


def test_a_gang_that_fits_one_worker_only_is_not_assigned_at_all(settings, sessions, redis):
    with sessions() as db:
        gpu_worker(db, "a", gpus=2, max_jobs=2)
        job = queued_gang(db, redis)
    report = run_pass(settings, sessions, redis)
    assert report.assigned == [] and report.nodes == [] and rows(sessions) == {} and held(sessions, job) == {}
    assert queued_ids(redis, QUEUE_PREFIX) == [job]


def test_a_node_never_taken_releases_the_forming_gang_and_it_is_planned_again(settings, sessions, redis, pool,
                                                                              monkeypatch):
    with sessions() as db:
        job = queued_gang(db, redis)
    [first] = run_pass(settings, sessions, redis).assigned
    claim_node_0(sessions, settings, monkeypatch, job, first.worker_id)
    [task] = run_pass(settings, sessions, redis, unclaimed_s=3600).handed
    undone = run_pass(settings, sessions, redis, unclaimed_s=0)  # node 1's worker never took its task
    assert list(undone.undone) == [job] and "node 1" in undone.undone[job] and "unclaimed" in undone.undone[job]
    with sessions() as db:
        row = db.get(Job, job)
        statuses = db.scalars(select(Attempt.status).where(Attempt.job_id == job)).all()
    assert row.status == JobStatus.QUEUED and row.attempt == 1 and statuses == ["preempted"]  # no retry spent
    assert task not in own_queue(redis, "a") + own_queue(redis, "b")
    assert not redis.exists(RQJob.key_for(task))  # never taken: its hash goes too
    # Planned again in that pass, but node 0's devices stay held until its worker, which the release stops, frees
    # them (here, by hand): then both nodes anew, all or none.
    assert undone.assigned == [] and undone.nodes == [] and rows(sessions) == {}
    with sessions() as db:
        workers.release(db, worker_id=first.worker_id, job_id=job)
        db.commit()
    again = run_pass(settings, sessions, redis)
    assert [p.node_rank for p in again.assigned + again.nodes] == [0, 1] and set(rows(sessions)) == {0, 1}


def test_a_node_whose_worker_is_lost_before_it_joined_undoes_the_whole_gang(settings, sessions, redis, pool,
                                                                              monkeypatch):
    with sessions() as db:
        job = queued_gang(db, redis)
    report = run_pass(settings, sessions, redis)
    [second] = report.nodes
    with sessions() as db:
        workers.remove(db, worker_id=second.worker_id)  # it stopped before node 0 was even claimed
        db.commit()
    undone = run_pass(settings, sessions, redis)
    assert undone.undone == {}  # node 0's assignment decides until the claim: it stands
    attempt = claim_node_0(sessions, settings, monkeypatch, job, report.assigned[0].worker_id)
    with sessions() as db:  # node 0's worker beats on (a loaded machine may run this test past a lease)
        assert workers.beat(db, worker_id=report.assigned[0].worker_id)
        db.commit()
    lost = run_pass(settings, sessions, redis)
    assert lost.undone == {job: f"node 1 on {second.worker_id}: lost"} and lost.handed == []
    with sessions() as db:
        assert (db.get(Job, job).status, db.get(Job, job).attempt) == (JobStatus.QUEUED, attempt)
    # Every node's assignment is gone and the lost node's devices are held no more (node 0's are its worker's to
    # free: a full suite's other passes may have freed them already, so they are not pinned here).
    assert rows(sessions) == {} and second.worker_id not in held(sessions, job)


def test_a_node_task_asks_its_assignment_naming_its_attempt(settings, sessions, redis, pool):
    control = DatabaseControl(sessions, settings)
    with pytest.raises(Refused) as refused:
        control.call("assignment", {"worker_id": "a", "job_id": "0" * 20, "node_rank": 1})
    assert "attempt" in str(refused.value)
    answer = control.call("assignment", {"worker_id": "a", "job_id": "0" * 20, "node_rank": 1, "attempt": 1})
    assert answer["state"] == "stale" and "unknown" in answer["reason"]


def test_a_forming_gang_whose_nodes_are_assigned_holds_no_other_worker(settings, sessions, redis, pool,
                                                                       monkeypatch):
    with sessions() as db:
        gpu_worker(db, "c", gpus=2, max_jobs=2)
        job = queued_gang(db, redis)
    report = run_pass(settings, sessions, redis)
    [first], [second] = report.assigned, report.nodes
    other = ({"a", "b", "c"} - {first.worker_id, second.worker_id}).pop()
    claim_node_0(sessions, settings, monkeypatch, job, first.worker_id)
    with sessions() as db:
        small = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            name="small", resources={"nproc_per_node": 2, "device": "cuda"})))
        db.commit()
        queue.enqueue(redis, prefix=QUEUE_PREFIX, job_id=small.id, priority="normal", timeout_s=60)
    # Node 1 is on its worker's queue, its devices held: the gang waits for no other worker, so the third one
    # takes the next job at once.
    after = run_pass(settings, sessions, redis)
    assert after.handed == [queue.node_task_id(job, 1, 1)]
    assert [(p.job_id, p.worker_id) for p in after.assigned] == [(small.id, other)]
