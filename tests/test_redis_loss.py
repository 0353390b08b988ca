"""Redis loses everything while jobs wait: the database rebuilds the queue, and each job runs exactly once."""

import time

from sqlalchemy import create_engine, select

from service.cli.stack import Stack
from service.jobs.models import Attempt
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL, _empty_tables, mlp_spec
from tests.helpers import free_port, queued_ids, wait_terminal

N_JOBS = 20
N_WORKERS = 2  # two torchrun launches at a time: about as many as a 2-core CI box runs well


def tiny_spec(i: int) -> dict:
    return mlp_spec(name=f"tiny-{i}", resources={"nnodes": 1, "nproc_per_node": 1, "device": "cpu"},
                    model={"type": "mlp", "hidden": [8]},
                    data={"type": "synthetic_regression", "num_samples": 64, "batch_size": 8},
                    train={"max_steps": 2, "log_every": 1, "seed": i})


def test_flushdb_with_queued_jobs_and_no_workers_then_each_job_succeeds_exactly_once(postgres_url, redis, tmp_path):
    """FLUSHDB (the test Redis db only: FLUSHALL would wipe other suites' dbs on a shared server) with 20 jobs
    queued and no worker running; then workers start and the reconciler rebuilds the queue from the database."""
    _empty_tables(postgres_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=postgres_url, redis_url=REDIS_URL,
                        queue_prefix=f"{QUEUE_PREFIX}flush", reconcile_s=1, poll_s=0.2)
    with Stack(settings, port=free_port(), workers=0, quiet=True) as stack:
        with stack.client(timeout=30) as api:
            ids = [api.post("/v1/jobs", json=tiny_spec(i)).json()["id"] for i in range(N_JOBS)]
            assert sorted(queued_ids(redis, prefix=settings.queue_prefix)) == sorted(ids)
            redis.flushdb()
            assert queued_ids(redis, prefix=settings.queue_prefix) == []
            started = time.monotonic()
            stack.add_workers(N_WORKERS)
            jobs = [wait_terminal(api, job_id, timeout=300) for job_id in ids]
            print(f"{N_JOBS} jobs on {N_WORKERS} workers after FLUSHDB: {time.monotonic() - started:.1f}s")
    assert [(j["status"], j["attempt"]) for j in jobs] == [("succeeded", 1)] * N_JOBS, [j["error"] for j in jobs]
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        attempts = conn.execute(select(Attempt.job_id, Attempt.number, Attempt.status)).all()
    engine.dispose()
    assert sorted(attempts) == sorted((job_id, 1, "succeeded") for job_id in ids)  # no job ran twice
