"""Shipping output to the database: byte offsets across attempts, split UTF-8, the per-job cap; a gang's progress."""

import json
import threading
import time
from datetime import timedelta

import psutil
from sqlalchemy import select, update
from sqlalchemy.exc import DataError, OperationalError

from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from service.jobs import service as jobs
from service.jobs.models import Attempt
from service.logs import service as logs
from service.metrics import service as metrics
from service.settings import Settings
from tests.conftest import mlp_spec
from trainjobs.runenv import RUN_TAG_ENV
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus
from worker.launch import Gang
from worker.shipping import LogShipper
from worker.supervisor import Shipped, Supervisor


def test_log_is_one_byte_stream_that_survives_split_utf8_and_keeps_its_head_and_tail_over_its_cap(settings):
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
        first = LogShipper(job_id=job_id, attempt=1, max_bytes=64)
        snowman = "☃".encode()
        first.stage(b"a" + snowman[:1])  # a character split across two reads
        _store(db, first)
        first.stage(snowman[1:] + b"b\n")
        _store(db, first)
        assert logs.read(db, job_id=job_id) == ("a☃b\n".encode(), 6)
        offset, seq = logs.log_size(db, job_id=job_id)  # what `open` answers a later attempt: it appends
        second = LogShipper(job_id=job_id, attempt=2, max_bytes=64, offset=offset, seq=seq)
        assert second.offset == 6
        second.stage(b"x" * 100)
        _store(db, second)
        assert logs.read(db, job_id=job_id)[0] == "a☃b\n".encode() + b"x" * 29  # the head of its 58 bytes' room
        second.stage(b"more", final=True)
        _store(db, second)
        data, end = logs.read(db, job_id=job_id)
        assert data == ("a☃b\n".encode() + b"x" * 29 + b"\n[trainjobs] ... 46 bytes of output cut here "
                        b"(log cap TRAINJOBS_LOG_MAX_BYTES=64) ...\n" + b"x" * 25 + b"more")
        assert logs.read(db, job_id=job_id, offset=end - 5) == (data[-5:], end)
    engine.dispose()


def _store(db, shipper: LogShipper) -> None:
    """What `ship` does with a batch's log part (service/runners/ship_calls.py); then the shipper moves on."""
    if (part := shipper.part()) is not None:
        logs.append(db, job_id=shipper.job_id, attempt=shipper.attempt, node_rank=shipper.node_rank, **part)
    db.commit()
    shipper.committed()


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
        sup.shipper.open(max_bytes=1 << 20)
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


def start_attempt(sessions, spec: JobSpec) -> str:
    """A job claimed as attempt 1 (node 0 holding a fresh lease), as worker/agent.py leaves it for its supervisor."""
    with sessions() as db:
        job_id = jobs.create(db, spec=spec).id
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.STARTING,
                                    values={"attempt": 1, "started_at": utcnow()})
        db.add(Attempt(job_id=job_id, number=1, worker="w0", node_rank=0, started_at=utcnow(),
                       lease_expires_at=lifecycle.lease_until(db, 10)))
        db.commit()
    return job_id


def script_spec(settings, tmp_path, name: str, code: str) -> tuple:
    """Settings of a worker that runs users' scripts, and the spec of a one-process job running `code`."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / name).write_text(code)
    allowed = settings.model_copy(update={"allow_entrypoints": True, "scripts_dir": scripts, "poll_s": 0.1,
                                          "heartbeat_s": 0.2})
    spec = JobSpec.model_validate(mlp_spec(model=None, data=None, entrypoint={"script": name},
                                           resources={"nnodes": 1, "nproc_per_node": 1, "device": "cpu"}))
    return allowed, spec


UNSTORABLE = """
import json, os, sys, time
sys.stdout.write("before\\x00after\\n")
with open(os.environ["TRAINJOBS_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"type": "progress", "time": time.time(), "total_steps": 1000}) + "\\n")
    for step, record in [(1, {"loss": 1.0, "bad\\x00name": 2.0}), (2, {"loss": float("nan")}),
                         (3, {"loss": 0.5, "step_time_s": 1e308})]:  # an ETA past any float
        f.write(json.dumps({"type": "metrics", "step": step, "time": time.time(), "metrics": record}) + "\\n")
    f.write(json.dumps({"type": "summary", "time": time.time(), "summary": {"final_loss": float("inf")}}) + "\\n")
"""


def test_a_nul_byte_or_a_nan_metric_is_stored_sanitized_and_the_job_succeeds(settings, tmp_path):
    """NUL in output and in a metric name (PostgreSQL refuses both) and a NaN value (SQLite refuses it) once failed
    every shipping commit, and with it the lease: now they are stored as U+FFFD or left out, and the log says so."""
    settings, spec = script_spec(settings, tmp_path, "unstorable.py", UNSTORABLE)
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    job_id = start_attempt(sessions, spec)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcome = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=1, spec=spec,
                         run_dir=run_dir).run()
    assert outcome.status == JobStatus.SUCCEEDED and outcome.summary == {"final_loss": None}
    with sessions() as db:
        text = logs.read(db, job_id=job_id)[0].decode()
        series = {s["name"]: dict(zip(s["steps"], s["values"], strict=True))
                  for s in metrics.read_series(db, job_id=job_id)}
        progress = jobs.get(db, job_id=job_id).progress
    # The absurd step time is the script's own, shown as it reported it (finite), and no ETA comes of it.
    assert progress == {"step": 3, "total_steps": 1000, "eta_s": None, "performance": {"step_time_s": 1e308}}
    assert "before\ufffdafter\n" in text
    assert ("[trainjobs] 1 NUL byte(s) of output stored as U+FFFD; 1 metric value(s) whose name held NUL stored "
            "under U+FFFD; 1 non-finite metric value(s) not stored (the first: loss = nan at step 2)\n") in text
    assert series == {"loss": {1: 1.0, 3: 0.5}, "bad\ufffdname": {1: 2.0}, "step_time_s": {3: 1e308}}
    engine.dispose()


def test_a_batch_the_database_refuses_costs_neither_the_lease_nor_the_log_and_alone_is_given_up_with_a_note(
        settings, tmp_path, monkeypatch):
    """The lease is renewed on its own thread, never with the data: a refused ship leaves it alone. The next ship
    sends the log and the metrics apart; a metric batch the database refuses on its own is given up and counted in
    the job's note, so it holds back neither the log nor the batches after it."""
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    spec = JobSpec.model_validate(mlp_spec())
    job_id = start_attempt(sessions, spec)
    sup = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=1, spec=spec, run_dir=tmp_path)
    sup.shipper.open(max_bytes=1 << 20)
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text(json.dumps({"type": "metrics", "step": 1, "time": time.time(),
                                        "metrics": {"loss": 1.0}}) + "\n")
    sup.logs.stage(b"hello\n")

    def refuse(*args, **kwargs):
        raise DataError("refused", None, Exception("a value the database refuses"))

    with monkeypatch.context() as m:
        for writer in ("insert_batch", "insert_points"):  # the points as rows, or as columns (the worker's)
            m.setattr(metrics, writer, refuse)
        assert sup._ship(_NoOutput()) is Shipped.REFUSED  # log and metrics together: refused
        with sessions() as db:
            assert logs.read(db, job_id=job_id)[0] == b""
        with sessions() as db:  # the lease, on its own: untouched by the refusal
            db.execute(update(Attempt).values(lease_expires_at=utcnow() + timedelta(seconds=1)))
            db.commit()
        assert sup.lease.renew() and not sup.lease_lost
        with sessions() as db:
            assert db.scalar(select(Attempt.lease_expires_at)) > utcnow() + timedelta(seconds=settings.lease_s - 2)
        assert sup._ship(_NoOutput()) is Shipped.STORED  # apart: the log is stored, the refused batch given up
    with open(metrics_file, "a") as f:
        f.write(json.dumps({"type": "metrics", "step": 2, "time": time.time(), "metrics": {"loss": 0.5}}) + "\n")
    sup._ship(_NoOutput())  # the batches after it are stored as usual
    with sessions() as db:
        assert logs.read(db, job_id=job_id)[0] == b"hello\n"
        assert metrics.read_series(db, job_id=job_id) == [{"name": "loss", "steps": [2], "values": [0.5]}]
    assert sup.metrics.note() == "kept 1 of 2 metric points; 1 in a batch the database refused"
    engine.dispose()


class _CutOff:
    """A worker's sessions until `cut()`: then the database is out of reach."""

    def __init__(self, sessions):
        self.sessions, self.out = sessions, False

    def __call__(self):
        if self.out:
            raise OperationalError("connect", None, Exception("connection refused"))
        return self.sessions()


def test_a_worker_cut_off_from_the_database_stops_its_ranks_once_its_lease_runs_out(settings, tmp_path):
    """Past its lease the sweeper gives the job to another attempt: the ranks of this one must not train on.
    They are stopped while the database is still away; once it is back, what they wrote is shipped (the
    supervisor drains however long the outage) and the attempt ends as a lost worker's."""
    settings, spec = script_spec(settings, tmp_path, "sleepy.py", "import time\nprint('up', flush=True)\n"
                                                                  "time.sleep(60)\n")
    settings = settings.model_copy(update={"lease_s": 2.0, "cancel_grace_s": 1.0})
    engine = make_engine(settings.database_url)
    sessions = _CutOff(make_sessionmaker(engine))
    job_id = start_attempt(sessions, spec)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sup = Supervisor(sessions=sessions, settings=settings, job_id=job_id, attempt=1, spec=spec, run_dir=run_dir)
    real_ship = sup._ship
    ranks_at_return: list[list] = []

    def back():  # the database returns 8 s in: the lease (2 s) and the grace (1 s) are long gone
        ranks_at_return.append([p for p in psutil.process_iter(["environ"])
                                if (p.info["environ"] or {}).get(RUN_TAG_ENV) == sup.tag])
        sessions.out = False

    def ship_then_cut(pump, **kwargs):
        shipped = real_ship(pump, **kwargs)
        if not sessions.out and not ranks_at_return and not hasattr(sup, "_cut"):
            sup._cut = threading.Timer(8.0, back)  # after the first renewal: the database goes away
            sup._cut.start()
            sessions.out = True
        return shipped

    sup._ship = ship_then_cut
    started = time.monotonic()
    outcome = sup.run()
    assert time.monotonic() - started < 15
    assert ranks_at_return == [[]]  # stopped while the database was still away
    assert outcome.status == JobStatus.FAILED and outcome.error["type"] == "worker_lost"
    assert "could not renew its lease" in outcome.error["message"]
    assert not [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get(RUN_TAG_ENV) == sup.tag]
    engine.dispose()


def test_a_stopped_early_trial_whose_ranks_ended_on_their_own_with_a_summary_succeeds(tmp_path):
    """A sweep's stop read before the supervisor had read the last steps (a trial of seconds): the ranks ended on
    their own, exit 0, with their summary: the work is done and the trial is kept (the new-user walkthrough's
    `cancelled (stopped_early)` at 300/300 steps). A stop that cut the work short stays a cancel."""
    spec = JobSpec.model_validate(mlp_spec(train={"max_steps": 300, "log_every": 10}))
    sup = Supervisor(sessions=None, settings=Settings(data_dir=tmp_path), job_id="j", attempt=1, spec=spec,
                     run_dir=tmp_path)
    sup.lease.held = lifecycle.Held(cancel_requested=True, progress_step=290, stopped_early=True)
    sup.metrics.last_step, sup.metrics.summary = 299, {"final_loss": 0.1}
    done = sup._outcome(0, "cancelled", [])
    assert done.status == JobStatus.SUCCEEDED and done.summary == {"final_loss": 0.1}
    sup.metrics.last_step = 150  # stopped halfway: its ranks were stopped, not done
    assert sup._outcome(0, "cancelled", []).status == JobStatus.CANCELLED
    sup.metrics.last_step = 299
    sup.lease.held = lifecycle.Held(cancel_requested=True, progress_step=290)  # the user's cancel: always a cancel
    assert sup._outcome(0, "cancelled", []).status == JobStatus.CANCELLED
