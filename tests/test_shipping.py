"""Shipping output to the database: byte offsets across attempts, split UTF-8, the per-job cap; a gang's progress."""

import json
import time
from datetime import timedelta

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt
from service.logs import service as logs
from tests.conftest import mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker.launch import Gang
from worker.shipping import LogShipper
from worker.supervisor import Supervisor


def test_log_is_one_byte_stream_that_survives_split_utf8_and_is_capped(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
        first = LogShipper(db, job_id=job_id, attempt=1, max_bytes=64)
        snowman = "☃".encode()
        first.stage(b"a" + snowman[:1])  # a character split across two reads
        first.write(db)
        db.commit()
        first.committed()
        first.stage(snowman[1:] + b"b\n")
        first.write(db)
        db.commit()
        first.committed()
        assert logs.read(db, job_id=job_id) == ("a☃b\n".encode(), 6)
        second = LogShipper(db, job_id=job_id, attempt=2, max_bytes=64)  # a later attempt appends
        assert second.offset == 6
        second.stage(b"x" * 100)
        second.write(db)
        db.commit()
        second.committed()
        second.stage(b"more")
        second.write(db)
        data, end = logs.read(db, job_id=job_id)
        assert data.startswith("a☃b\n".encode() + b"x" * 58) and data.endswith(b"log truncated at 64 bytes\n")
        assert b"more" not in data
        assert logs.read(db, job_id=job_id, offset=end - 5) == (data[-5:], end)
    engine.dispose()


class _NoOutput:
    def take(self) -> bytes:
        return b""


def test_a_gang_s_progress_is_node_0_s_or_a_node_that_is_ahead_of_it(settings, tmp_path):
    """A user's script that reports on RANK 0 alone reports from whichever node c10d gave that rank: a node
    other than 0 moves the job's progress when it is ahead, and never takes it back."""
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    spec = JobSpec.model_validate(mlp_spec(resources={"nnodes": 2, "nproc_per_node": 1},
                                           train={"max_steps": 100, "log_every": 10}))
    with sessions() as db:
        job_id = jobs.create(db, spec=spec).id
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.STARTING,
                                    values={"attempt": 1, "started_at": utcnow()})
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING, attempt=1)
        for node in (0, 1):
            db.add(Attempt(job_id=job_id, number=1, worker=f"w{node}", node_rank=node, started_at=utcnow(),
                           lease_expires_at=utcnow() + timedelta(seconds=60)))
        db.commit()

    def node(rank: int) -> Supervisor:
        gang = Gang(nnodes=2, node_rank=rank, endpoint="127.0.0.1:1", local_addr="127.0.0.1", join_timeout_s=30)
        run_dir = tmp_path / f"node-{rank}"
        run_dir.mkdir()
        sup = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=1, spec=spec, run_dir=run_dir,
                         gang=gang)
        with sessions() as db:
            sup.logs = LogShipper(db, job_id=job_id, attempt=1, node_rank=rank, max_bytes=1 << 20)
        return sup

    def report(sup: Supervisor, step: int) -> None:
        with (sup.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"type": "metrics", "step": step, "time": time.time(), "metrics": {"loss": 1.0}}) + "\n")
        sup._ship(_NoOutput())

    def progress() -> int:
        with sessions() as db:
            return jobs.get(db, job_id=job_id).progress["step"]

    zero, one = node(0), node(1)
    zero._ship(_NoOutput())  # node 0 reports nothing: its script reports on RANK 0, which c10d put on node 1
    report(one, 10)
    assert progress() == 10
    zero._ship(_NoOutput())  # a node 0 that has reported nothing does not reset it
    assert progress() == 10
    report(one, 20)
    assert progress() == 20
    one.metrics.last_step = 0  # a node behind the stored step does not take it back (a stale node, a slow tail)
    one._ship(_NoOutput())
    assert progress() == 20
    report(zero, 30)  # node 0 reports: its progress is the job's
    assert progress() == 30
    engine.dispose()
