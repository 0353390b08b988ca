"""`trainjobs submit --follow` and `trainjobs logs --follow` on the event stream: live progress, the job's
outcome as the exit code, reconnection with Last-Event-ID, and no polling."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import lifecycle
from service.logs import service as logs
from service.metrics import service as metrics
from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for
from trainjobs.states import JobStatus


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    """A live API without workers: each test moves its job through its states by hand."""
    with live_stack(postgres_url, tmp_path_factory.mktemp("follow"), name="follow", workers=0) as stack:
        yield stack


@pytest.fixture
def db(postgres_url):
    engine = create_engine(postgres_url)
    with Session(engine) as session:
        yield session
    engine.dispose()


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(mlp_spec(name="followed")))
    return str(path)


def trainjobs(stack, *argv: str, api_url: str | None = None) -> subprocess.Popen:
    """The real command in a process of its own, as a user runs it."""
    env = {**os.environ, "TRAINJOBS_API_URL": api_url or stack.api_url, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    if stack.token:
        env["TRAINJOBS_TOKEN"] = stack.token
    return subprocess.Popen([sys.executable, "-m", "service.cli", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def newest_job(stack) -> str | None:
    with stack.client() as api:
        items = api.get("/v1/jobs", params={"limit": 1}).json()["items"]
    return items[0]["id"] if items else None


def submit(stack, spec_file: str, *argv: str, api_url: str | None = None) -> tuple[subprocess.Popen, str]:
    """`trainjobs submit` in a process of its own, and the id of the job it made."""
    before = newest_job(stack)
    proc = trainjobs(stack, "submit", spec_file, *argv, api_url=api_url)
    return proc, wait_for(lambda: (newest_job(stack) or before) != before and newest_job(stack), 20,
                          what="the submitted job")


def move(db: Session, job_id: str, to: JobStatus, **values) -> None:
    assert lifecycle.transition(db, job_id=job_id, to=to, values=values)
    db.commit()


def start(db: Session, job_id: str) -> None:
    move(db, job_id, JobStatus.STARTING, attempt=1, started_at=utcnow())
    move(db, job_id, JobStatus.RUNNING, progress={"step": 0, "total_steps": 20})


def add_points(db: Session, job_id: str, steps: range) -> None:
    rows = [(s, name, value, utcnow()) for s in steps for name, value in (("loss", 1.0 / (s + 1)),
                                                                          ("samples_per_s", 5000.0))]
    metrics.insert_batch(db, job_id=job_id, attempt=1, rows=rows)
    db.commit()


def request_count(stack, route: str) -> float:
    with stack.client() as api:
        text = api.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "trainjobs_http_request_duration_seconds_count" and s.labels.get("route") == route)


class DroppingProxy:
    """A TCP proxy in front of the API that keeps what passes through and can cut every open connection."""

    def __init__(self, upstream_port: int):
        self.upstream_port, self.server = upstream_port, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.up, self.down, self.sockets = bytearray(), [], []  # all requests; each connection's responses
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            self.down.append(bytearray())
            threading.Thread(target=self._pump, args=(client, upstream, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.down[-1]), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(65536):
                record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def drop(self) -> None:
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sockets.clear()

    def close(self) -> None:
        self.drop()
        self.server.close()

    def events_sent(self) -> list[list[tuple[str, str, dict]]]:
        """(id, kind, data) of every event sent down, per connection that carried any."""
        found = [re.findall(rb"id: (\d+)\r\nevent: (\w+)\r\ndata: (.*?)\r\n", bytes(d)) for d in self.down]
        return [[(i.decode(), k.decode(), json.loads(v)) for i, k, v in events] for events in found if events]

    def last_event_ids(self) -> list[str | None]:
        """The Last-Event-ID of each request for an event stream, in order."""
        heads = re.findall(rb"GET /v1/jobs/\w+/events(?:\?\S*)? HTTP/1.1\r\n(.*?)\r\n\r\n", bytes(self.up), re.S)
        return [(re.findall(rb"(?im)^last-event-id: (\d+)", h) or [None])[0] for h in heads]


def test_submit_follow_shows_a_real_jobs_progress_and_exits_0(postgres_url, tmp_path, spec_file):
    with live_stack(postgres_url, tmp_path / "data", name="followreal", workers=1) as real:
        proc, job_id = submit(real, spec_file, "--follow")
        log_follower = trainjobs(real, "logs", job_id, "--follow")
        code, out = finish(proc, timeout=120)
        log_code, followed = finish(log_follower)
        with real.client() as api:
            stored = api.get(f"/v1/jobs/{job_id}/logs").text
            rank0 = api.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0}).text  # what follow shows by default
        listing = subprocess.run([sys.executable, "-m", "service.cli", "list"], capture_output=True, text=True,
                                 env={**os.environ, "TRAINJOBS_API_URL": real.api_url, "COLUMNS": "160",
                                      **({"TRAINJOBS_TOKEN": real.token} if real.token else {})}).stdout
    assert code == 0, out
    assert "20/20" in out and "loss " in out and "samples/s" in out and "succeeded" in out and "summary" in out
    printed = [line for line in rank0.splitlines() if line.strip()]  # follow prints rank 0's output, in order
    assert "[rank0]: " in stored and "[rank" not in rank0 and len(printed) > 3, (stored, rank0)
    at = [out.find(line) for line in printed]
    assert printed and -1 not in at and at == sorted(at), (printed, out)
    assert log_code == 0 and followed == stored and "samples/s" in stored  # every byte, once, in order
    assert re.search(rf"{job_id}.*followed.*succeeded.*ddp.*1×2.*20/20", listing), listing


def test_follow_resumes_with_last_event_id_after_the_connection_drops(stack, db, spec_file):
    proxy = DroppingProxy(stack.port)
    try:
        proc, job_id = submit(stack, spec_file, "--follow", "--json", api_url=proxy.url)
        # The follower asks for points from its attaching on (`metrics=new`): attached first, then points.
        wait_for(proxy.events_sent, 10, what="the follower to attach")
        start(db, job_id)
        add_points(db, job_id, range(0, 3))
        wait_for(lambda: any(k == "metrics" for c in proxy.events_sent() for _i, k, _d in c), 10,
                 what="the first points to be sent")
        seen = proxy.events_sent()[-1][-1][0]
        proxy.drop()  # mid-job: the follower must reconnect and resume from the last event it saw
        wait_for(lambda: len(proxy.events_sent()) == 2 and len(proxy.events_sent()[1]) >= 2, 10,
                 what="the follower to reconnect")
        add_points(db, job_id, range(3, 6))
        move(db, job_id, JobStatus.SUCCEEDED, progress={"step": 20, "total_steps": 20})
        code, out = finish(proc)
    finally:
        proxy.close()
    assert code == 0, out
    assert json.loads(out)["status"] == "succeeded"
    assert proxy.last_event_ids() == [None, seen.encode()]
    assert bytes(proxy.up).count(b"/events?metrics=new HTTP/1.1") == 2
    _first, again = proxy.events_sent()
    assert [k for _i, k, _d in again[:2]] == ["status", "progress"]  # the state again, on reconnect
    resumed = [s for _i, k, d in again if k == "metrics" for s in d["series"][0]["steps"]]
    assert resumed == [3, 4, 5]  # only the points not seen before the drop
    assert again[-1][1:] == ("status", {"status": "succeeded"})


@pytest.mark.parametrize(("end", "code"), [(JobStatus.FAILED, 1), (JobStatus.CANCELLED, 130)])
def test_submit_follow_exits_with_the_jobs_outcome(stack, db, spec_file, end, code):
    proc, job_id = submit(stack, spec_file, "--follow")
    start(db, job_id)
    error = {"type": "ValueError", "message": "bad batch", "rank": 1} if end is JobStatus.FAILED else None
    move(db, job_id, end, error=error, finished_at=utcnow())
    returncode, out = finish(proc)
    assert returncode == code, out
    assert end.value in out
    if error:
        assert "ValueError on rank 1: bad batch" in out


def test_ctrl_c_stops_following_with_130_and_leaves_the_job_alone(stack, spec_file):
    reads_before = request_count(stack, "/v1/jobs/{job_id}")
    proc, job_id = submit(stack, spec_file, "--follow")
    wait_for(lambda: request_count(stack, "/v1/jobs/{job_id}") > reads_before, 10, what="the follower to start")
    proc.send_signal(signal.SIGINT)
    returncode, out = finish(proc)
    with stack.client() as api:
        job = api.get(f"/v1/jobs/{job_id}").json()
    assert returncode == 130, out
    assert f"stopped following job {job_id}; it keeps running" in out
    assert job["status"] == "queued" and job["cancel_requested_at"] is None


def test_logs_follow_reads_the_log_only_when_the_stream_says_it_grew(stack, db):
    with stack.client() as api:
        job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    start(db, job_id)
    reads_before = request_count(stack, "/v1/jobs/{job_id}/logs")
    proc = trainjobs(stack, "logs", job_id, "--follow", "--json")
    wait_for(lambda: request_count(stack, "/v1/jobs/{job_id}/logs") > reads_before, 10, what="the first read")
    offset = 0
    for seq, text in enumerate(["rank 0 up\n", "step 5 loss 0.5\n", "step 10 loss 0.2\n"], start=1):
        offset += logs.append(db, job_id=job_id, attempt=1, start=offset, seq=seq, text=text)
        db.commit()
        # each line must reach the follower before the next is written: it is pushed, not found on a timer
        wait_for(lambda n=seq: request_count(stack, "/v1/jobs/{job_id}/logs") >= reads_before + n + 1, 10,
                 what=f"the follower to read line {seq}")
    idle = request_count(stack, "/v1/jobs/{job_id}/logs")
    threading.Event().wait(2)  # 2 s with nothing new (20 ticks of the server's poll): no read at all
    assert request_count(stack, "/v1/jobs/{job_id}/logs") == idle
    move(db, job_id, JobStatus.SUCCEEDED, finished_at=utcnow())
    returncode, out = finish(proc)
    assert returncode == 0, out
    assert [json.loads(line)["text"] for line in out.splitlines()] == ["rank 0 up\n", "step 5 loss 0.5\n",
                                                                        "step 10 loss 0.2\n"]


def test_submit_follow_prints_a_ranks_error_as_text_and_exits_with_the_outcome(stack, db, spec_file):
    proc, job_id = submit(stack, spec_file, "--follow")
    start(db, job_id)
    move(db, job_id, JobStatus.FAILED, finished_at=utcnow(),
         error={"type": "RuntimeError", "message": "[rank0]: boom [/] [bold]x[/bold]", "rank": 0})
    returncode, out = finish(proc)
    assert returncode == 1, out
    assert "RuntimeError on rank 0: [rank0]: boom [/] [bold]x[/bold]" in out


def test_an_api_error_quoting_the_users_text_prints_it_as_text(stack):
    returncode, out = finish(trainjobs(stack, "status", "[rank0]"))
    assert returncode == 2, out
    assert "error: no job matches '[rank0]'" in out  # not a job id: looked up as a name, and said so


def test_logs_follow_asks_the_stream_for_no_points(stack, db):
    """A follower of the log reads no metric history (`metrics=none`), however long the series."""
    with stack.client() as api:
        job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    start(db, job_id)
    add_points(db, job_id, range(0, 50))
    proxy = DroppingProxy(stack.port)
    try:
        proc = trainjobs(stack, "logs", job_id, "--follow", "--json", api_url=proxy.url)
        wait_for(proxy.events_sent, 10, what="the follower to attach")
        add_points(db, job_id, range(50, 53))
        logs.append(db, job_id=job_id, attempt=1, start=0, seq=1, text="done\n")
        move(db, job_id, JobStatus.SUCCEEDED, finished_at=utcnow())
        returncode, out = finish(proc)
    finally:
        proxy.close()
    assert returncode == 0 and json.loads(out)["text"] == "done\n", out
    assert b"/events?metrics=none HTTP/1.1" in bytes(proxy.up)
    assert [k for c in proxy.events_sent() for _i, k, _d in c if k == "metrics"] == []


def test_follow_without_a_terminal_prints_each_change_of_status_and_why_it_waits():
    """CI logs, a file, a pipe: no live bar is drawn there, so a waiting job's reason must still be said."""
    import io

    from rich.console import Console

    from service.cli.follow import follow_events
    from trainjobs.client import Event

    class Stub:
        def __init__(self):
            self.job = {"id": "j1", "name": "tiny", "status": "queued", "pending_reason": None,
                        "progress": {"step": 0, "total_steps": 10}}

        def get(self, job_id):
            return self.job

        def follow_events(self, job_id, metrics="new"):
            why = "waiting for a free worker: 1 fit, 1 busy"
            yield Event("status", {"status": "queued", "pending_reason": why}, "1")
            yield Event("progress", {"step": 0, "total_steps": 10}, "2")  # no change of status: no line
            yield Event("status", {"status": "running"}, "3")
            yield Event("progress", {"step": 10, "total_steps": 10}, "4")
            self.job = {**self.job, "status": "succeeded"}
            yield Event("status", {"status": "succeeded"}, "5")

    out = io.StringIO()
    follow_events(Stub(), "j1", Console(file=out, width=200))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("tiny j1: ")]
    assert lines == ["tiny j1: 0/10 queued", "tiny j1: 0/10 queued: waiting for a free worker: 1 fit, 1 busy",
                     "tiny j1: 0/10 running", "tiny j1: 10/10 succeeded"], out.getvalue()


def test_the_outcome_shows_a_missing_summary_value_as_a_dash_not_python_none():
    import io

    from rich.console import Console

    from service.cli.follow import print_outcome

    out = io.StringIO()
    job = {"id": "j1", "status": "succeeded", "summary": {"final_loss": 0.25, "resumed_from_step": None}}
    assert print_outcome(job, Console(file=out, width=120)) == 0
    assert "None" not in out.getvalue() and "resumed_from_step" in out.getvalue() and "0.25" in out.getvalue()


def test_submit_follow_and_status_say_why_a_real_queued_job_waits(stack, db, spec_file):
    """No worker in this stack: the sweeper writes the job's pending_reason; the follower (no terminal: a line per
    change) and `trainjobs status` both say it."""
    proc, job_id = submit(stack, spec_file, "--follow")
    with stack.client() as api:
        wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["pending_reason"], 20, what="a pending reason")
        reason = api.get(f"/v1/jobs/{job_id}").json()["pending_reason"]
        status = subprocess.run([sys.executable, "-m", "service.cli", "status", job_id[:14]], capture_output=True,
                                text=True, env={**os.environ, "TRAINJOBS_API_URL": stack.api_url, "COLUMNS": "160",
                                                **({"TRAINJOBS_TOKEN": stack.token} if stack.token else {})})
        threading.Event().wait(1)  # the follower's event stream carries the reason within a poll
        api.post(f"/v1/jobs/{job_id}/cancel")
    returncode, out = finish(proc)
    assert reason.startswith("no live worker"), reason
    assert returncode == 130 and f"followed {job_id}: 0/20 queued: {reason}" in out, out
    assert status.returncode == 0 and re.search(rf"waiting\s+│?\s*{re.escape(reason)}", status.stdout), status.stdout
