"""An attempt's shipping through the worker protocol (issue 42, service/runners/ship_calls.py): one batch a call,
numbered by the worker, applied once however often it is sent (a retry after a lost answer, an API restart), only
for the caller's own attempt, nothing for an attempt that lost its job, and bad input refused naming its field.
Live: a joined worker's job keeps every line of output and every metric step exactly once across an API crash."""

import re
import time
from collections import Counter

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import lifecycle
from service.jobs.models import JobEvent
from tests.api_restart import restart_api
from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for, wait_terminal
from tests.test_worker_join import as_worker, join, join_token
from trainjobs.spec import JobSpec
from worker.attempt.ship import Shipped
from worker.control import DatabaseControl, Refused, Unreachable
from worker.supervisor import Supervisor


@pytest.fixture
def attempt(client, settings) -> dict:
    """A job claimed by runner gpu-7's worker (its first attempt's node 0), and gpu-7's and gpu-8's credentials."""
    mine = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        number, _ = lifecycle.claim(db, job_id=job_id, worker="gpu-7-5", lease_s=60)
        db.commit()
    yield {"ref": {"job_id": job_id, "attempt": number, "node_rank": 0}, "mine": mine, "other": other,
           "control": DatabaseControl(sessionmaker(engine), settings), "engine": engine}
    engine.dispose()


def points_of(client, job_id: str) -> Counter:
    """How many points the job's API serves as stored, per (name, step): every stored row (format=csv)."""
    rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"format": "csv"}).text.splitlines()[1:]
    return Counter((name, int(step)) for step, name, *_ in (row.split(",") for row in rows))


def test_a_batch_sent_again_is_acknowledged_and_its_lines_and_points_stored_once(client, attempt):
    ref, job_id, now = attempt["ref"], attempt["ref"]["job_id"], time.time()
    first = {**ref, "seq": 1, "log": {"start": 0, "seq": 1, "text": "line 1\nline 2\n"},
             "points": [[1, "loss", 0.5, now], [2, "loss", 0.25, now]],
             "progress": {"step": 2, "total_steps": 20, "eta_s": None}}
    answers = [client.post("/v1/worker/ship", json=first, headers=as_worker(attempt["mine"])).json()
               for _ in range(2)]  # the answer lost: the same batch again
    assert answers == [{"applied": True, "lost": False}, {"applied": False, "lost": False}]
    assert client.get(f"/v1/jobs/{job_id}/logs").text == "line 1\nline 2\n"
    assert points_of(client, job_id) == {("loss", 1): 1, ("loss", 2): 1}
    assert client.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 2

    control = attempt["control"]  # the same calls in-process, for a worker holding the database's URL
    second = {**ref, "seq": 2, "log": {"start": 14, "seq": 2, "text": "line 3\n"}, "points": [[3, "loss", 0.1, now]]}
    assert control.call("ship", second) == {"applied": True, "lost": False}
    assert control.call("ship", second) == {"applied": False, "lost": False}
    assert control.call("ship", first) == {"applied": False, "lost": False}  # an older batch, late
    assert client.get(f"/v1/jobs/{job_id}/logs").text == "line 1\nline 2\nline 3\n"
    assert points_of(client, job_id) == {("loss", 1): 1, ("loss", 2): 1, ("loss", 3): 1}
    # What a supervisor starting on this attempt again would start from.
    assert control.call("open", ref) == {"log_bytes": 21, "log_seq": 3, "metric_names": ["loss"], "metric_points": 3,
                                         "seq": 2, "event_seq": 0}


class LosesAnswers:
    """The control plane, with the answers to the next `lose` ships lost on their way back: applied, then
    Unreachable to the worker, as when the API is cut off (or killed) after its commit."""

    def __init__(self, control: DatabaseControl):
        self.control, self.lose, self.sent = control, 0, []

    def call(self, name: str, body: dict) -> dict | None:
        answer = self.control.call(name, body)
        if name == "ship":
            self.sent.append((body["seq"], body.get("log", {}).get("text")))
            if self.lose:
                self.lose -= 1
                raise Unreachable("the answer was lost")
        return answer


class Output:
    def __init__(self):
        self.data = b""

    def take(self) -> bytes:
        data, self.data = self.data, b""
        return data


def test_a_supervisor_sends_a_batch_whose_answer_was_lost_again_as_it_was_and_it_is_stored_once(
        client, settings, attempt, tmp_path):
    ref, job_id = attempt["ref"], attempt["ref"]["job_id"]
    control = LosesAnswers(attempt["control"])
    sup = Supervisor(sessions=sessionmaker(attempt["engine"]), settings=settings, job_id=job_id,
                     attempt=ref["attempt"], spec=JobSpec.model_validate(mlp_spec()), run_dir=tmp_path,
                     control=control)
    sup.shipper.open(max_bytes=1 << 20)
    (tmp_path / "metrics.jsonl").write_text(f'{{"type": "metrics", "step": 1, "time": {time.time()}, '
                                            f'"metrics": {{"loss": 0.5}}}}\n')
    output, control.lose = Output(), 1
    output.data = b"hello\n"
    assert sup._ship(output) is Shipped.UNREACHABLE  # stored, but the worker cannot know
    output.data = b"world\n"  # staged meanwhile: it waits for the next batch
    assert sup._ship(output) is Shipped.STORED  # the same batch again: acknowledged, not applied twice
    assert sup._ship(output) is Shipped.STORED  # then the next
    assert control.sent == [(1, "hello\n"), (1, "hello\n"), (2, "world\n")]
    assert client.get(f"/v1/jobs/{job_id}/logs").text == "hello\nworld\n"
    assert points_of(client, job_id) == {("loss", 1): 1}


def test_an_event_sent_twice_is_stored_once(client, attempt):
    event = {**attempt["ref"], "seq": 1, "kind": "store_waiting", "detail": "the store is out of reach"}
    for _ in range(2):
        answer = client.post("/v1/worker/event", json=event, headers=as_worker(attempt["mine"]))
    assert answer.json() == {"applied": False, "lost": False}
    with Session(attempt["engine"]) as db:
        assert db.scalar(select(func.count()).where(JobEvent.job_id == event["job_id"],
                                                    JobEvent.kind == "store_waiting")) == 1


def test_a_batch_for_another_runner_s_attempt_is_refused(client, attempt):
    batch = {**attempt["ref"], "seq": 1, "log": {"start": 0, "seq": 1, "text": "not yours\n"}}
    for call, body in (("ship", batch), ("open", attempt["ref"]),
                       ("event", {**attempt["ref"], "seq": 1, "kind": "store_back"})):
        refused = client.post(f"/v1/worker/{call}", json=body, headers=as_worker(attempt["other"]))
        assert refused.status_code == 403 and "gpu-8" in refused.json()["detail"], call
    assert client.post("/v1/worker/ship", json=batch).status_code == 401  # a user's token
    assert client.get(f"/v1/jobs/{batch['job_id']}/logs").text == ""


def test_a_batch_of_an_attempt_that_lost_its_job_answers_lost_and_writes_nothing(client, attempt):
    ref = attempt["ref"]
    before = client.get(f"/v1/jobs/{ref['job_id']}").json()["progress"]
    with Session(attempt["engine"]) as db:  # the job given back (the sweeper took it from a lost worker)
        assert lifecycle.hand_back(db, job_id=ref["job_id"], attempt=ref["attempt"], detail="taken back")
        db.commit()
    batch = {**ref, "seq": 1, "log": {"start": 0, "seq": 1, "text": "too late\n"}, "points": [[1, "loss", 1.0, 0.0]],
             "progress": {"step": 1, "total_steps": 20, "eta_s": None}}
    answer = client.post("/v1/worker/ship", json=batch, headers=as_worker(attempt["mine"]))
    assert answer.json() == {"applied": False, "lost": True}
    assert attempt["control"].call("ship", batch) == {"applied": False, "lost": True}
    assert client.get(f"/v1/jobs/{ref['job_id']}/logs").text == ""
    assert points_of(client, ref["job_id"]) == {}
    assert client.get(f"/v1/jobs/{ref['job_id']}").json()["progress"] == before


@pytest.mark.parametrize(("part", "field"), [
    ({"seq": 0}, "seq"),
    ({"points": [[1, "x" * 65, 1.0, 0.0]]}, "points"),
    ({"points": [[1, "loss", "nan", 0.0]]}, "points"),
    ({"log": {"start": -1, "seq": 1, "text": ""}}, "start"),
    ({"warnings": [{"kind": "succeeded", "attempt": 1, "message": "a forged event"}]}, "kind"),
    ({"progress": {"step": 2**31}}, "step"),
])
def test_bad_input_to_ship_names_the_field(client, attempt, part, field):
    body = {**attempt["ref"], "seq": 1, **part}
    bad = client.post("/v1/worker/ship", json=body, headers=as_worker(attempt["mine"]))
    assert bad.status_code == 422 and field in bad.text, bad.text
    with pytest.raises(Refused) as refused:
        attempt["control"].call("ship", body)
    assert refused.value.status == 422 and field in refused.value.detail


LINES = 400
NUMBERED = f"""
import os, time
from trainjobs import report

for i in range({LINES}):
    print(f"numbered line {{i}}", flush=True)
    report(i, total_steps={LINES}, loss=1.0 / (i + 1))
    time.sleep(0.05)
"""


def test_a_joined_worker_s_job_keeps_every_line_and_step_exactly_once_across_an_api_crash(postgres_url, tmp_path):
    """The API is SIGKILLed while a joined worker's job runs and ships, and started again: batches sent into the
    crash (their answers lost) are sent again as they were, and the API applies each once."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "numbered.py").write_text(NUMBERED)
    # NOTE: a lease well past the API's restart on a loaded machine, so the restarted sweeper expires nothing.
    with live_stack(postgres_url, tmp_path / "stack", name="ship", workers=0, lease_s=90, allow_entrypoints=True,
                    scripts_dir=scripts) as stack:
        with stack.client(timeout=10) as api:
            token = api.post("/v1/worker-tokens", json={"uses": 1}).json()["token"]
            stack.add_workers(1, env={"TRAINJOBS_WORKER_API": stack.api_url, "TRAINJOBS_WORKER_JOIN_TOKEN": token,
                                      "TRAINJOBS_WORKER_NAME": "gpu-7",
                                      "TRAINJOBS_WORKER_CREDENTIAL_FILE": str(tmp_path / "cred")})
            wait_for(lambda: any(w["id"] == "gpu-7" for w in api.get("/v1/workers").json()["items"]), 120,
                     what="the joined worker to register through the API")
            job_id = start_numbered(api)
        restart_api(stack, down_s=2)
        with stack.client(timeout=10) as api:
            assert_each_line_and_step_once(api, job_id)


def start_numbered(api) -> str:
    """Submit the numbered script (the scripts dir holds it as numbered.py) and wait until it has shipped lines."""
    spec = mlp_spec(model=None, data=None, entrypoint={"script": "numbered.py"},
                    resources={"nnodes": 1, "nproc_per_node": 1, "device": "cpu"})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_for(lambda: "numbered line 30\n" in api.get(f"/v1/jobs/{job_id}/logs").text
             or api.get(f"/v1/jobs/{job_id}").json()["status"] in ("failed", "cancelled"), 180,
             what="the job to ship its first lines")
    assert "numbered line 30\n" in api.get(f"/v1/jobs/{job_id}/logs").text, api.get(f"/v1/jobs/{job_id}").json()
    return job_id


def assert_each_line_and_step_once(api, job_id: str) -> None:
    """The numbered job succeeded on its first attempt with every line and every step stored exactly once."""
    job = wait_terminal(api, job_id, timeout=240)
    log = api.get(f"/v1/jobs/{job_id}/logs").text
    points = points_of(api, job_id)
    assert job["status"] == "succeeded" and job["attempt"] == 1, job
    assert Counter(re.findall(r"numbered line (\d+)\n", log)) == {str(i): 1 for i in range(LINES)}
    assert {step: n for (name, step), n in points.items() if name == "loss"} == {i: 1 for i in range(LINES)}
