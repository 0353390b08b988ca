"""GET /v1/jobs/{id}/events: a live SSE stream of status, progress and metrics, resumable by Last-Event-ID."""

import gc
import json
import queue
import threading
import time

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session

from service.api import events
from service.api.app import create_app
from service.db import make_engine, utcnow
from service.jobs import lifecycle
from service.metrics import service as metrics
from tests.conftest import admin_token, mlp_spec
from tests.helpers import free_port, wait_for
from trainjobs.states import JobStatus


@pytest.fixture
def api(settings, redis):
    """A real uvicorn in a thread: the TestClient collects a whole body before it returns one."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings.model_copy(update={"poll_s": 0.1})),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, what="uvicorn to start")
    headers = {"Authorization": f"Bearer {admin_token(settings)}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=headers) as client:
        yield client
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def db(settings):
    engine = make_engine(settings.database_url)
    with Session(engine) as session:
        yield session
    engine.dispose()


class Stream:
    """Reads an SSE stream in a thread into a queue, so the test can change the job while it is open."""

    def __init__(self, api: httpx.Client, job_id: str, last_event_id: str | None = None, **params):
        self.events: queue.Queue = queue.Queue()
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        self.thread = threading.Thread(target=self._read, args=(api, job_id, headers, params), daemon=True)
        self.thread.start()

    def _read(self, api, job_id, headers, params):
        for event in read_events(api, job_id, headers, params):
            self.events.put(event)
        self.events.put(None)  # the server ended the stream

    def next(self, kind: str | None = None, timeout: float = 10) -> dict | None:
        """The next event (skipping other kinds when one is named); None once the stream has ended."""
        while True:
            event = self.events.get(timeout=timeout)
            if event is None or kind is None or event["event"] == kind:
                return event


def read_events(api: httpx.Client, job_id: str, headers: dict | None = None, params: dict | None = None):
    fields: dict = {}
    with api.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers or {}, params=params or {}) as r:
        for line in r.iter_lines():
            if not line:
                if "event" in fields:
                    yield {**fields, "data": json.loads(fields["data"])}
                fields = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                fields[key] = value.removeprefix(" ")


def move(db: Session, job_id: str, to: JobStatus, **values) -> None:
    assert lifecycle.transition(db, job_id=job_id, to=to, values=values)
    db.commit()


def add_points(db: Session, job_id: str, steps: range, attempt: int = 1) -> None:
    metrics.insert_batch(db, job_id=job_id, attempt=attempt, rows=[(s, "loss", 1.0 / (s + 1), utcnow()) for s in steps])
    db.commit()


def test_stream_shows_status_progress_and_metrics_as_they_happen_and_ends_after_the_terminal_status(api, db):
    job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    stream = Stream(api, job_id)
    assert stream.next("status")["data"] == {"status": "queued"}
    move(db, job_id, JobStatus.STARTING, attempt=1, started_at=utcnow())
    assert stream.next("status")["data"] == {"status": "starting"}
    move(db, job_id, JobStatus.RUNNING, progress={"step": 5, "eta_s": 3.0})
    assert stream.next("status")["data"] == {"status": "running"}
    assert stream.next("progress")["data"] == {"step": 5, "eta_s": 3.0}
    add_points(db, job_id, range(0, 5))
    event = stream.next("metrics")
    assert event["data"]["series"][0]["steps"] == [0, 1, 2, 3, 4] and int(event["id"]) > 0
    add_points(db, job_id, range(5, 8))
    move(db, job_id, JobStatus.SUCCEEDED, progress={"step": 8, "eta_s": 0.0})
    rest = []
    while (event := stream.next()) is not None:
        rest.append(event)
    assert rest[-1]["event"] == "status" and rest[-1]["data"] == {"status": "succeeded"}
    assert [s for e in rest if e["event"] == "metrics" for s in e["data"]["series"][0]["steps"]] == [5, 6, 7]
    assert [e["data"] for e in rest if e["event"] == "status"] == [{"status": "succeeded"}]


def test_reconnect_with_last_event_id_resends_status_and_only_the_unseen_points(api, db):
    job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    move(db, job_id, JobStatus.STARTING, attempt=1, started_at=utcnow())
    move(db, job_id, JobStatus.RUNNING, progress={"step": 3})
    add_points(db, job_id, range(0, 3))
    first = Stream(api, job_id)
    seen = first.next("metrics")
    assert seen["data"]["series"][0]["steps"] == [0, 1, 2]
    add_points(db, job_id, range(3, 6))
    again = Stream(api, job_id, last_event_id=seen["id"])
    assert again.next()["data"] == {"status": "running"}
    assert again.next()["data"] == {"step": 3}
    resumed = again.next()
    assert resumed["event"] == "metrics" and resumed["data"]["series"][0]["steps"] == [3, 4, 5]
    assert int(resumed["id"]) > int(seen["id"])
    move(db, job_id, JobStatus.CANCELLED)
    assert again.next("status")["data"] == {"status": "cancelled"} and again.next() is None
    assert first.next("status")["data"] == {"status": "cancelled"} and first.next() is None


def test_the_metrics_answer_s_cursor_starts_the_stream_after_the_points_it_held(api, db):
    """A chart loads GET .../metrics (thinned), then follows the stream from that answer's cursor: the stream
    does not send the whole series again, and a gang's other nodes are never in it."""
    job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    move(db, job_id, JobStatus.STARTING, attempt=1, started_at=utcnow())
    move(db, job_id, JobStatus.RUNNING, progress={"step": 1000})
    add_points(db, job_id, range(0, 1000))
    loaded = api.get(f"/v1/jobs/{job_id}/metrics", params={"max_points": 50}).json()
    assert len(loaded["series"][0]["steps"]) <= 50 and loaded["series"][0]["steps"][-1] == 999
    metrics.insert_batch(db, job_id=job_id, attempt=1, node_rank=1,
                         rows=[(s, "loss", 5.0, utcnow()) for s in range(1000, 1003)])  # another node's
    add_points(db, job_id, range(1000, 1002))
    stream = Stream(api, job_id, last_event_id=str(loaded["cursor"]))
    fresh = stream.next("metrics")
    assert fresh["data"]["series"] == [{"name": "loss", "steps": [1000, 1001], "values": [1 / 1001, 1 / 1002]}]
    move(db, job_id, JobStatus.CANCELLED)
    assert stream.next("status")["data"] == {"status": "cancelled"} and stream.next() is None


def test_a_finished_job_streams_everything_once_then_closes(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    client.post(f"/v1/jobs/{job_id}/cancel")
    r = client.get(f"/v1/jobs/{job_id}/events")  # finite, so the TestClient can read it whole
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = [line.split(":", 1)[1].strip() for line in r.text.splitlines() if line.startswith("event:")]
    assert kinds == ["progress", "status"] and '"cancelled"' in r.text


def test_events_of_an_unknown_job_are_404_and_a_bad_last_event_id_is_422(client):
    assert client.get("/v1/jobs/0123456789abcdef0123/events").status_code == 404
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    r = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x1"})
    assert r.status_code == 422 and r.json()["field"] == "Last-Event-ID"


def peak_rss_mib() -> float:
    """This process's peak RSS since the last reset_peak_rss (the API runs in it: see the `api` fixture)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@pytest.mark.alone  # the first batch within 1 s
def test_a_long_series_is_streamed_in_batches_and_followers_skip_it(api, db):
    """200k points: attaching answers at once, one reader of the whole series holds a batch at a time, and ten
    followers of the log and status (`metrics=none`, as `logs --follow`) or of new points only (`metrics=new`,
    as `submit --follow`) read none of it. Before: each stream loaded the whole series before its first event
    (4.4 s and +112 MiB of API memory for 1.4M points)."""
    job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    move(db, job_id, JobStatus.STARTING, attempt=1, started_at=utcnow())
    move(db, job_id, JobStatus.RUNNING, progress={"step": 200_000})
    for start in range(0, 200_000, 20_000):
        add_points(db, job_id, range(start, start + 20_000))
    gc.collect()
    reset_peak_rss()
    before = peak_rss_mib()

    followers = [Stream(api, job_id, metrics="none" if i % 2 else "new") for i in range(10)]
    for stream in followers:
        assert stream.next(timeout=5)["data"] == {"status": "running"}
    started = time.monotonic()
    points, batches, first_after = 0, 0, None
    for event in read_events(api, job_id):
        first_after = first_after or time.monotonic() - started
        if event["event"] == "metrics":
            rows = sum(len(s["steps"]) for s in event["data"]["series"])
            assert rows <= events.BATCH_ROWS
            points, batches = points + rows, batches + 1
        if points == 200_000:
            break
    assert first_after < 1.0 and batches == 200_000 // events.BATCH_ROWS
    add_points(db, job_id, range(200_000, 200_003))
    for stream in followers[::2]:  # `new`: only the points written after attaching
        assert stream.next("metrics")["data"]["series"][0]["steps"] == [200_000, 200_001, 200_002]
    move(db, job_id, JobStatus.CANCELLED)
    for stream in followers:
        seen = []
        while (event := stream.next()) is not None:
            seen.append(event["event"])
        assert "metrics" not in seen and seen[-1] == "status"
    grown = peak_rss_mib() - before
    assert grown < 40, f"the API's peak RSS grew by {grown:.0f} MiB"  # before: ~15 MiB per stream (200k rows)
