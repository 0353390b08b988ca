"""A worker frozen (SIGSTOP) while it holds its job's row loses the job within a few seconds past its lease.

PostgreSQL's idle_in_transaction_session_timeout does not end such a session in two states that shipping
reaches (service/db.py, make_engine): frozen inside a psycopg pipeline (executemany: `active`), and frozen
right after one that ended with a Flush after its Sync (it disarms the timer: `idle in transaction`, no
timer). The holder here is a real process, frozen in each state with a 1 s idle timeout that would otherwise
have ended it; the sweeper must settle the lease regardless, and the woken worker must write nothing.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select, text, update

import service.db
from service.db import UNREACHABLE, make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt, Job
from service.metrics import service as metrics
from service.metrics.models import Metric
from tests.conftest import _empty_tables, mlp_spec
from tests.helpers import wait_for
from trainjobs.spec import JobSpec
from trainjobs.states import AttemptStatus, JobStatus

WORKER = "frozen-worker-1"
SENTINEL = 4242.0  # the metric value whose encoding, in the pipeline, freezes the holder
COMMITTED, ENDED = 3, 0  # the holder's exit codes once woken: its batch was stored / its session had been ended


def hold_and_freeze(url: str, job_id: str, attempt: str, where: str) -> None:
    """The holder (its own process): what a supervisor's shipping does, frozen at `where`, then its commit."""
    service.db.IDLE_IN_TRANSACTION_S = 1.0  # the server's idle timeout alone would free the row in 1 s, if it could
    engine = make_engine(url, application_name=WORKER)
    if where == "inside_pipeline":
        from psycopg.types.numeric import FloatBinaryDumper, FloatDumper
        from sqlalchemy import event

        def freezing(base):
            class Freezing(base):
                def dump(self, obj):
                    if obj == SENTINEL:  # the rows before it are sent; their Sync is not
                        os.kill(os.getpid(), signal.SIGSTOP)
                    return super().dump(obj)
            return Freezing

        @event.listens_for(engine, "connect")
        def _freeze_on_sentinel(dbapi_conn, _record):
            for base in (FloatDumper, FloatBinaryDumper):
                dbapi_conn.adapters.register_dumper(float, freezing(base))

    try:
        with make_sessionmaker(engine)() as db:
            assert lifecycle.hold(db, job_id=job_id, attempt=int(attempt), node_rank=0, lease_s=60.0) is not None
            rows = [(step, name, SENTINEL if (step, name) == (3, "loss") else 1.0, utcnow())
                    for step in range(1, 6) for name in ("loss", "lr")]
            metrics.insert_batch(db, job_id=job_id, attempt=int(attempt), rows=rows)  # an executemany
            db.flush()  # the block summaries: an executemany too, the last statement before the freeze
            if where == "after_pipeline":
                # NOTE: psycopg sends this Flush after the Sync only when the results are still on their way (the
                # timing decides); sent here, the state is certain: `idle in transaction`, the timer disarmed.
                pgconn = db.connection().connection.dbapi_connection.pgconn
                pgconn.send_flush_request()
                pgconn.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
            db.commit()
    except UNREACHABLE:
        os._exit(ENDED)
    os._exit(COMMITTED)


@pytest.fixture
def sessions(postgres_url):
    _empty_tables(postgres_url)
    engine = make_engine(postgres_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def running_job(sessions) -> tuple[str, int]:
    """A running job whose attempt 1 is WORKER's, with a lease that has run out in the database."""
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec(max_retries=1))).id
        db.execute(update(Job).where(Job.id == job_id).values(not_before=None))
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker=WORKER, lease_s=0.1)
        assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="ranks launched")
        db.commit()

    def expired() -> bool:
        with sessions() as db:  # a transaction each time: now() is its start
            return db.scalar(select(Attempt.lease_expires_at < func.now()).where(Attempt.job_id == job_id))

    wait_for(expired, 5, interval=0.05, what="the lease to run out")
    return job_id, attempt


class Sweep(threading.Thread):
    """One lease pass of the sweeper, in a thread: what it settled and how long it took, once it has ended."""

    def __init__(self, sessions):
        super().__init__(daemon=True)
        self.sessions, self.settled, self.took = sessions, None, None
        self.start()

    def run(self) -> None:
        with self.sessions() as db:
            started = time.monotonic()
            self.settled = lifecycle.expire_leases(db)
            self.took = time.monotonic() - started

    def result(self, timeout: float) -> tuple[list[str] | None, float]:
        """(what it settled, how long it took), or (None, timeout) while it is still blocked."""
        self.join(timeout)
        return (self.settled, self.took) if self.took is not None else (None, timeout)


@pytest.mark.parametrize("where", ["inside_pipeline", "after_pipeline"])
@pytest.mark.alone  # a lease timed around a frozen process (see test_lost_worker's paused test)
def test_a_worker_frozen_holding_its_job_loses_it_past_its_lease_and_writes_nothing(sessions, postgres_url,
                                                                                     where):
    job_id, attempt = running_job(sessions)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from tests.test_frozen_worker import "
                               "hold_and_freeze; hold_and_freeze(*sys.argv[1:])", postgres_url, job_id, str(attempt),
                               where], cwd=Path(__file__).resolve().parents[1])
    settled = None
    try:
        wait_for(lambda: holder.poll() is not None or psutil.Process(holder.pid).status() == psutil.STATUS_STOPPED,
                 30, what="the holder to freeze")
        assert holder.poll() is None, f"the holder exited with {holder.returncode} before it froze"
        time.sleep(1.5)  # past its idle timeout: a session the server could end is gone by now

        settled, took = Sweep(sessions).result(timeout=10)
        assert settled == [job_id], f"the sweeper was still blocked by the frozen holder after {took:.0f}s"
        assert took < lifecycle.SWEEP_LOCK_WAIT_S * 2 + 2
    finally:
        if holder.poll() is None:
            if settled != [job_id]:
                holder.kill()  # its session ends with it: a blocked sweeper goes on
            os.kill(holder.pid, signal.SIGCONT)
        holder.wait(30)

    assert holder.returncode == ENDED  # woken, it found its session ended: its batch was never stored
    with sessions() as db:
        job = db.get(Job, job_id)
        lost = db.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        written = db.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id))
        assert (job.status, lost.status) == (JobStatus.QUEUED, AttemptStatus.LOST)
        assert lost.error["type"] == "worker_lost" and written == 0


@pytest.mark.alone  # a lease timed around a frozen process (see test_lost_worker's paused test)
def test_a_holder_that_commits_while_the_sweeper_waits_keeps_its_session_and_its_renewal_wins(sessions,
                                                                                             postgres_url):
    job_id, attempt = running_job(sessions)
    engine = make_engine(postgres_url, application_name=WORKER)
    with make_sessionmaker(engine)() as holder:
        assert lifecycle.hold(holder, job_id=job_id, attempt=attempt, node_rank=0, lease_s=60.0) is not None
        sweep = Sweep(sessions)
        with sessions() as db:
            wait_for(lambda: "Lock" in db.scalars(text(
                "SELECT wait_event_type FROM pg_stat_activity WHERE datname = current_database()")).all(), 10,
                interval=0.02, what="the sweeper to wait for the job's row")
        holder.commit()  # the renewal, within the sweeper's wait
        settled, took = sweep.result(timeout=10)
    engine.dispose()
    assert settled == [] and took < lifecycle.SWEEP_LOCK_WAIT_S + 1
    with sessions() as db:
        assert db.get(Job, job_id).status == JobStatus.RUNNING
        assert db.scalars(select(Attempt.status).where(Attempt.job_id == job_id)).one() == AttemptStatus.ACTIVE
