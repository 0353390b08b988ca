"""service/jobs/lifecycle.py on its own, on both databases: every compare-and-set has exactly one winner.

Races run for real: threads whose sessions each read the job and are then released at once by a barrier, or
two sessions interleaved so both read before either writes. No worker, no Redis.
"""

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from service.db import make_engine, make_sessionmaker, utcnow
from service.errors import InvalidTransition
from service.jobs import lifecycle, records
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job, JobEvent
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import ALLOWED_FROM, TERMINAL, AttemptStatus, ErrorType, JobStatus

LEASE_S = 30.0
CRASH = {"type": "process_exit", "message": "rank 0 got SIGKILL", "rank": 0}


@pytest.fixture
def sessions(db_url):
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def new_job(sessions, *, nnodes: int = 1, max_retries: int = 0, running: bool = False) -> str:
    """A queued job, or (running) one whose attempt 1 runs on every node."""
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(
            max_retries=max_retries, resources={"nnodes": nnodes, "nproc_per_node": 1, "device": "cpu"}))).id
        db.commit()
    if running:
        claim(sessions, job_id, nnodes=nnodes)
    return job_id


def claim(sessions, job_id: str, *, nnodes: int = 1, run: bool = True) -> int:
    """Claim the job (node 0), join its other nodes, and move it to running."""
    with sessions() as db:
        db.execute(update(Job).where(Job.id == job_id).values(not_before=None))  # past any backoff
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=LEASE_S)
        db.commit()
        for rank in range(1, nnodes):
            assert lifecycle.join(db, job_id=job_id, attempt=attempt, node_rank=rank, worker=f"w{rank}",
                                  lease_s=LEASE_S) is not None
            db.commit()
        if run:
            assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="ranks launched")
            db.commit()
    return attempt


def state(sessions, job_id: str) -> tuple[Job, list[Attempt]]:
    with sessions() as db:
        job = db.get(Job, job_id)
        attempts = db.scalars(select(Attempt).where(Attempt.job_id == job_id)
                              .order_by(Attempt.number, Attempt.node_rank)).all()
        db.expunge_all()
        return job, list(attempts)


def events(sessions, job_id: str, kind: str) -> int:
    with sessions() as db:
        return db.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id,
                                                                          JobEvent.kind == kind))


def expire(sessions, job_id: str) -> None:
    with sessions() as db:
        db.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.status == AttemptStatus.ACTIVE)
                   .values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        db.commit()


def call(sessions, fn, **kwargs):
    """One lifecycle function in its own session, committed."""
    with sessions() as db:
        result = fn(db, **kwargs)
        db.commit()
        return result


def race(sessions, job_id: str, *steps) -> list:
    """Each step(db) in its own thread and session: each reads the job, then all are released at once."""
    barrier = threading.Barrier(len(steps))

    def run(step):
        with sessions() as db:
            seen = db.get(Job, job_id)  # held, so the step acts on this read; on PostgreSQL it opens the transaction
            assert seen is not None
            barrier.wait(timeout=10)
            result = step(db)
            db.commit()
            return result

    with ThreadPoolExecutor(len(steps)) as pool:
        return [future.result(timeout=30) for future in [pool.submit(run, step) for step in steps]]


# --- races ---------------------------------------------------------------------------------------------------

def test_two_claims_of_one_queued_job_give_it_to_exactly_one(sessions):
    job_id = new_job(sessions)
    got = race(sessions, job_id, *[lambda db, w=w: lifecycle.claim(db, job_id=job_id, worker=w, lease_s=LEASE_S)
                                   for w in ("w0", "w1")])
    winners = [g for g in got if g is not None]
    assert len(winners) == 1 and winners[0][0] == 1 and winners[0][1].name == "mlp-ddp"
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.STARTING and job.attempt == 1
    assert [(a.number, a.status) for a in attempts] == [(1, AttemptStatus.ACTIVE)]
    assert events(sessions, job_id, JobStatus.STARTING) == 1


@pytest.mark.parametrize("first", ["cancel", "claim"])
def test_a_cancel_racing_a_claim_never_leaves_a_cancelled_job_with_an_attempt(sessions, first):
    """Both sessions read the queued job, then one commits before the other writes."""
    job_id = new_job(sessions)
    with sessions() as api, sessions() as worker:
        seen = api.get(Job, job_id), worker.get(Job, job_id)  # held: the API's cancel acts on what it read
        assert [job.status for job in seen] == [JobStatus.QUEUED] * 2
        if first == "cancel":
            assert lifecycle.request_cancel(api, job_id=job_id)[1] is True
            assert lifecycle.claim(worker, job_id=job_id, worker="w0", lease_s=LEASE_S) is None
            worker.commit()
        else:
            assert lifecycle.claim(worker, job_id=job_id, worker="w0", lease_s=LEASE_S)[0] == 1
            worker.commit()
            was_queued = lifecycle.request_cancel(api, job_id=job_id)[1]
    job, attempts = state(sessions, job_id)
    assert not (job.status == JobStatus.CANCELLED and attempts), f"cancelled with attempts {attempts[0].status}"
    if first == "cancel":
        assert job.status == JobStatus.CANCELLED and attempts == []
    else:  # the claim won: the job is the worker's, asked to stop (and not dropped from the queue as queued)
        assert job.status == JobStatus.STARTING and job.cancel_requested_at is not None and not was_queued
        assert [a.status for a in attempts] == [AttemptStatus.ACTIVE]
        held = call(sessions, lifecycle.hold, job_id=job_id, attempt=1, node_rank=0, lease_s=LEASE_S)
        assert held is not None and held.cancel_requested


def test_a_renewal_committed_before_the_sweepers_update_keeps_the_attempt(sessions, monkeypatch):
    job_id = new_job(sessions, running=True, max_retries=1)
    expire(sessions, job_id)
    lock_job, renewed = lifecycle.lock_job, []

    def renew_then_lock(db, job_id):  # the sweeper has read the lease expired; the node renews it now
        if not renewed:
            renewed.append(call(sessions, lifecycle.hold, job_id=job_id, attempt=1, node_rank=0, lease_s=LEASE_S))
        return lock_job(db, job_id)

    monkeypatch.setattr(lifecycle, "lock_job", renew_then_lock)
    with sessions() as db:
        assert lifecycle.expire_leases(db) == []
    assert renewed and renewed[0] is not None  # the race did happen, and the renewal held the job
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.RUNNING and job.attempt == 1 and job.error is None
    assert attempts[0].status == AttemptStatus.ACTIVE and attempts[0].lease_expires_at > utcnow()


def test_a_renewal_after_the_sweeper_lost_the_attempt_gets_nothing(sessions):
    job_id = new_job(sessions, running=True, max_retries=1)
    expire(sessions, job_id)
    with sessions() as sweeper, sessions() as node:
        assert node.get(Job, job_id).status == JobStatus.RUNNING  # the node read the job before the sweep
        assert lifecycle.expire_leases(sweeper) == [job_id]
        assert lifecycle.hold(node, job_id=job_id, attempt=1, node_rank=0, lease_s=LEASE_S) is None
        node.rollback()
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.error["type"] == ErrorType.WORKER_LOST
    assert attempts[0].status == AttemptStatus.LOST and attempts[0].lease_expires_at is None


def test_two_nodes_of_a_gang_finishing_at_once_succeed_the_job_exactly_once(sessions):
    job_id = new_job(sessions, running=True, nnodes=2)

    def finish(rank):
        return lambda db: lifecycle.finish_node(db, job_id=job_id, attempt=1, node_rank=rank,
                                                status=JobStatus.SUCCEEDED, exit_code=0, error=None,
                                                summary={"loss": 0.1} if rank == 0 else None)

    assert race(sessions, job_id, finish(0), finish(1)) == [True, True]
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.SUCCEEDED and job.summary == {"loss": 0.1} and job.finished_at is not None
    assert [a.status for a in attempts] == [AttemptStatus.SUCCEEDED] * 2
    assert events(sessions, job_id, JobStatus.SUCCEEDED) == 1


def test_a_stale_attempt_changes_nothing_once_the_job_moved_to_the_next(sessions):
    job_id = new_job(sessions, running=True, max_retries=1)
    expire(sessions, job_id)
    assert call(sessions, lifecycle.expire_leases) == [job_id]
    assert claim(sessions, job_id) == 2
    old = {"job_id": job_id, "attempt": 1}
    assert call(sessions, lifecycle.settle_failure, **old, error=CRASH) is None
    assert not call(sessions, lifecycle.finish_node, **old, node_rank=0, status=JobStatus.SUCCEEDED,
                    summary={"x": 1}, error=None, exit_code=0)
    assert not call(sessions, lifecycle.hand_back, **old, detail="worker shutting down")
    assert not call(sessions, lifecycle.start_running, **old, detail="late")
    assert call(sessions, lifecycle.hold, **old, node_rank=0, lease_s=LEASE_S) is None
    call(sessions, records.record_progress, **old, progress={"step": 99})
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.RUNNING and job.attempt == 2 and job.summary is None and job.progress is None
    assert [a.status for a in attempts] == [AttemptStatus.LOST, AttemptStatus.ACTIVE]
    assert events(sessions, job_id, JobStatus.FAILED) == events(sessions, job_id, JobStatus.SUCCEEDED) == 0
    # the attempt that holds the job still writes
    call(sessions, records.record_progress, job_id=job_id, attempt=2, progress={"step": 5})
    call(sessions, records.record_resume, job_id=job_id, attempt=2, node_rank=0, step=4)
    assert call(sessions, lifecycle.hold, job_id=job_id, attempt=2, node_rank=0, lease_s=LEASE_S).progress_step == 5
    assert state(sessions, job_id)[1][1].resumed_from_step == 4


# --- rules ---------------------------------------------------------------------------------------------------

def test_a_failure_requeues_with_a_growing_backoff_while_retries_remain_then_fails_listing_every_cause(sessions):
    job_id = new_job(sessions, running=True, max_retries=2)
    for attempt, wait_s in ((1, 2), (2, 4)):
        error = {**CRASH, "message": f"crash {attempt}"}
        assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=attempt, error=error) == JobStatus.QUEUED
        job, _ = state(sessions, job_id)
        assert job.status == JobStatus.QUEUED
        assert wait_s - 1 < (job.not_before - utcnow()).total_seconds() <= wait_s
        assert claim(sessions, job_id) == attempt + 1
    error = {**CRASH, "message": "crash 3"}
    assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=3, error=error) == JobStatus.FAILED
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.FAILED and job.finished_at is not None
    assert [(c["attempt"], c["message"]) for c in job.error["attempts"]] == [(n, f"crash {n}") for n in (1, 2, 3)]
    assert [a.status for a in attempts] == [AttemptStatus.FAILED] * 3


def test_a_final_error_fails_the_job_at_once_with_retries_left(sessions):
    job_id = new_job(sessions, running=True, max_retries=3)
    error = {"type": "ValueError", "message": "lr must be positive", "rank": 0}
    assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=1, error=error) == JobStatus.FAILED
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.FAILED and job.error["type"] == "ValueError"
    assert [a.status for a in attempts] == [AttemptStatus.FAILED]


def test_a_lost_worker_is_retried_without_waiting_and_only_once_its_lease_expired(sessions):
    job_id = new_job(sessions, running=True, max_retries=1)
    lost = {"type": ErrorType.WORKER_LOST, "message": "worker w0 stopped renewing its lease"}
    settle = {"job_id": job_id, "attempt": 1, "error": lost, "attempt_status": AttemptStatus.LOST,
              "only_if_expired": True}  # the sweeper's
    assert call(sessions, lifecycle.settle_failure, **settle) is None  # its lease is still good
    assert state(sessions, job_id)[0].status == JobStatus.RUNNING
    expire(sessions, job_id)
    assert call(sessions, lifecycle.settle_failure, **settle) == JobStatus.QUEUED
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.not_before <= utcnow()
    assert [a.status for a in attempts] == [AttemptStatus.LOST]


def test_a_worker_that_stopped_its_own_ranks_past_its_lease_closes_the_attempt_lost_at_once(sessions):
    """Cut off from the database past its lease, a supervisor stops its ranks; its drain then renews the lease
    (to store what they wrote), so its own `lost` needs no expired lease: the retry does not wait a lease."""
    job_id = new_job(sessions, running=True, max_retries=1)
    lost = {"type": ErrorType.WORKER_LOST, "message": "the worker could not renew its lease"}
    assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=1, error=lost,
                attempt_status=AttemptStatus.LOST) == JobStatus.QUEUED
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.QUEUED and [a.status for a in attempts] == [AttemptStatus.LOST]


def test_a_worker_whose_clock_is_8s_behind_keeps_its_attempt(sessions, monkeypatch):
    """Leases are set and judged by the database's clock: a worker's slow clock no longer makes every attempt
    look expired to the sweeper from the start."""
    job_id = new_job(sessions)
    with monkeypatch.context() as m:  # the worker's machine: claim, join, renew all read its clock
        m.setattr(lifecycle, "utcnow", lambda: utcnow() - timedelta(seconds=8))
        with sessions() as db:
            attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=5)
            db.commit()
            assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="ranks launched")
            assert lifecycle.hold(db, job_id=job_id, attempt=attempt, node_rank=0, lease_s=5) is not None
            db.commit()
    assert call(sessions, lifecycle.expire_leases) == []  # the sweeper, on a machine with the right time
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.RUNNING and attempts[0].status == AttemptStatus.ACTIVE
    assert attempts[0].lease_expires_at > utcnow() + timedelta(seconds=3)  # 5 s from the database's now


def test_a_hand_back_requeues_the_job_without_spending_a_retry(sessions):
    job_id = new_job(sessions, running=True, max_retries=1)
    assert call(sessions, lifecycle.hand_back, job_id=job_id, attempt=1, detail="worker shutting down")
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.not_before <= utcnow()
    assert [a.status for a in attempts] == [AttemptStatus.PREEMPTED]
    assert claim(sessions, job_id) == 2
    # the one retry is still there: a failure now requeues
    assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=2, error=CRASH) == JobStatus.QUEUED


def test_a_cancel_requested_during_a_hand_back_wins(sessions):
    job_id = new_job(sessions, running=True, max_retries=1)
    with sessions() as worker:
        assert worker.get(Job, job_id).cancel_requested_at is None  # the worker read it before the cancel
        assert call(sessions, lifecycle.request_cancel, job_id=job_id)[1] is False
        assert lifecycle.hand_back(worker, job_id=job_id, attempt=1, detail="worker shutting down")
        worker.commit()
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.CANCELLED and job.finished_at is not None
    assert [a.status for a in attempts] == [AttemptStatus.PREEMPTED]


def test_releasing_a_forming_gang_closes_every_node_as_preempted_and_requeues_it(sessions):
    job_id = new_job(sessions, nnodes=3)
    claim(sessions, job_id, nnodes=2, run=False)  # two of its three nodes
    release = {"job_id": job_id, "attempt": 1, "why": "gang not formed in 60s (2 of 3 nodes)"}
    assert call(sessions, lifecycle.release_gang, **release)
    assert not call(sessions, lifecycle.release_gang, **release)  # once
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.QUEUED and job.pending_reason == release["why"] and job.not_before <= utcnow()
    assert [(a.node_rank, a.status) for a in attempts] == [(0, AttemptStatus.PREEMPTED), (1, AttemptStatus.PREEMPTED)]
    assert {a.error["type"] for a in attempts} == {ErrorType.GANG_STOPPED}
    assert claim(sessions, job_id, nnodes=3) == 2  # a gang that formed and runs is not released
    assert not call(sessions, lifecycle.release_gang, job_id=job_id, attempt=2, why="late")
    assert state(sessions, job_id)[0].status == JobStatus.RUNNING


def test_transition_makes_exactly_the_moves_in_allowed_from_and_terminal_states_never_change(sessions):
    job_id = new_job(sessions)
    assert not any(s in ALLOWED_FROM[to] for to in JobStatus for s in TERMINAL)
    with sessions() as db:
        for source in JobStatus:
            for to in JobStatus:
                db.execute(update(Job).where(Job.id == job_id).values(status=source))
                moved = lifecycle.transition(db, job_id=job_id, to=to)
                assert moved == (source in ALLOWED_FROM[to]), (source, to)
                assert db.scalar(select(Job.status).where(Job.id == job_id)) == (to if moved else source)
                db.rollback()


def test_a_gang_node_dying_after_a_cancel_was_asked_ends_the_job_cancelled_not_failed(sessions):
    """A peer's SIGTERM can kill node 1's ranks before its supervisor reads the cancel flag (issue 13, item 15)."""
    job_id = new_job(sessions, nnodes=2, running=True, max_retries=2)
    call(sessions, lifecycle.request_cancel, job_id=job_id)
    peer_died = {"type": "RuntimeError", "message": "Connection closed by peer", "rank": None}
    assert call(sessions, lifecycle.settle_failure, job_id=job_id, attempt=1, error=peer_died,
                node_rank=1) == JobStatus.CANCELLED
    assert not call(sessions, lifecycle.finish_node, job_id=job_id, attempt=1, node_rank=0,
                    status=JobStatus.CANCELLED, summary=None, error=None, exit_code=-15)
    job, attempts = state(sessions, job_id)
    assert job.status == JobStatus.CANCELLED and job.error is None and job.attempt == 1  # no retry either
    assert [a.status for a in attempts] == [AttemptStatus.CANCELLED, AttemptStatus.CANCELLED]


def test_cancelling_a_finished_job_is_refused_and_changes_nothing(sessions):
    job_id = new_job(sessions, running=True)
    assert call(sessions, lifecycle.finish_node, job_id=job_id, attempt=1, node_rank=0, status=JobStatus.SUCCEEDED,
                summary=None, error=None, exit_code=0)
    with pytest.raises(InvalidTransition):
        call(sessions, lifecycle.request_cancel, job_id=job_id)
    job, _ = state(sessions, job_id)
    assert job.status == JobStatus.SUCCEEDED and job.cancel_requested_at is None
