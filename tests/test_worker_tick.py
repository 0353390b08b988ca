"""The worker protocol's `tick` (issue 42, service/runners/tick_calls.py): one request carries a worker's
heartbeat, every lease it renews and every batch its attempts ship, answered part by part as the single calls
would answer; sent again it doubles nothing; another runner's attempt refuses the whole tick naming the item; an
attempt that lost its job is told so while the others are stored; a batch the database refuses is refused alone.
And the worker's relay (worker/tick.py) turns its attempts' calls into ticks."""

import threading
import time
from datetime import datetime

import pytest
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import lifecycle
from service.jobs.models import Attempt, JobEvent
from service.logs.models import LogChunk
from service.metrics.models import Metric, MetricBlock
from service.runners import protocol
from service.runners.points import PointColumns
from service.runners.streams import AttemptStream
from service.runners.tick_calls import TickBody, tick
from tests.conftest import mlp_spec
from tests.test_worker_join import INVENTORY, as_worker, join, join_token
from tests.test_worker_ship import points_of
from worker.control import ApiControl, DatabaseControl, Refused
from worker.tick import Relay, Relayed

WORKER = "gpu-7-5"


@pytest.fixture
def running(client, settings) -> dict:
    """Three jobs claimed by runner gpu-7's worker gpu-7-5 (registered), and gpu-7's and gpu-8's credentials."""
    mine = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    assert client.post("/v1/worker/register", json={"worker_id": WORKER, **INVENTORY},
                       headers=as_worker(mine)).status_code == 204
    engine = create_engine(settings.resolved_database_url)
    refs = []
    with Session(engine) as db:
        for _ in range(3):
            job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
            number, _ = lifecycle.claim(db, job_id=job_id, worker=WORKER, lease_s=5)
            db.commit()
            refs.append({"job_id": job_id, "attempt": number, "node_rank": 0})
    yield {"refs": refs, "mine": as_worker(mine), "other": as_worker(other), "engine": engine,
           "control": DatabaseControl(sessionmaker(engine), settings)}
    engine.dispose()


def leases_end(engine, refs: list[dict]) -> list[datetime]:
    with Session(engine) as db:
        return [db.scalar(select(Attempt.lease_expires_at).where(Attempt.job_id == r["job_id"],
                                                                 Attempt.number == r["attempt"])) for r in refs]


def batch(ref: dict, seq: int, *, text: str, steps: range, start: int = 0) -> dict:
    now = time.time()
    return {**ref, "seq": seq, "log": {"start": start, "seq": seq, "text": text},
            "points": [[s, "loss", 1.0 / s, now] for s in steps],
            "progress": {"step": steps[-1], "total_steps": 100, "eta_s": None}}


def test_one_tick_beats_renews_every_lease_and_stores_every_batch_once_however_often_it_is_sent(client, running):
    refs, before = running["refs"], leases_end(running["engine"], running["refs"])
    body = {"heartbeat": {"worker_id": WORKER}, "leases": refs,
            "ships": [batch(refs[0], 1, text="a 1\n", steps=range(1, 3)),
                      batch(refs[1], 1, text="b 1\n", steps=range(1, 4))],
            "events": [{**refs[2], "seq": 1, "kind": "store_waiting", "detail": "the store is away"}]}
    first = client.post("/v1/worker/tick", json=body, headers=running["mine"])
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["heartbeat"] == {"registered": True}
    assert [(lease["job_id"], lease["held"]["cancel_requested"]) for lease in answer["leases"]] == \
        [(r["job_id"], False) for r in refs]
    assert answer["ships"] == [{"applied": True, "lost": False, "refused": None}] * 2
    assert answer["events"] == [{"applied": True, "lost": False, "refused": None}]
    assert all(after > earlier for after, earlier in zip(leases_end(running["engine"], refs), before, strict=True))
    assert client.get(f"/v1/jobs/{refs[0]['job_id']}/logs").text == "a 1\n"
    assert points_of(client, refs[1]["job_id"]) == {("loss", 1): 1, ("loss", 2): 1, ("loss", 3): 1}
    assert client.get(f"/v1/jobs/{refs[1]['job_id']}").json()["progress"]["step"] == 3

    again = client.post("/v1/worker/tick", json=body, headers=running["mine"]).json()  # its answer was lost
    assert again["ships"] == [{"applied": False, "lost": False, "refused": None}] * 2
    assert again["events"] == [{"applied": False, "lost": False, "refused": None}]
    assert client.get(f"/v1/jobs/{refs[0]['job_id']}/logs").text == "a 1\n"
    assert points_of(client, refs[1]["job_id"]) == {("loss", 1): 1, ("loss", 2): 1, ("loss", 3): 1}
    with Session(running["engine"]) as db:
        assert db.scalar(select(func.count()).select_from(JobEvent).where(
            JobEvent.job_id == refs[2]["job_id"], JobEvent.kind == "store_waiting")) == 1


def test_a_tick_naming_another_runner_s_attempt_is_refused_whole_naming_the_item(client, running):
    refs = running["refs"]
    body = {"heartbeat": {"worker_id": WORKER}, "leases": refs[:1],
            "ships": [batch(refs[0], 1, text="mine\n", steps=range(1, 2))]}
    refused = client.post("/v1/worker/tick", json=body, headers=running["other"])
    assert refused.status_code == 403
    assert "gpu-8" in refused.json()["detail"]
    assert client.post("/v1/worker/tick", json={"heartbeat": {"worker_id": "gpu-8-1"}, "ships": body["ships"]},
                       headers=running["other"]).status_code == 403
    assert client.post("/v1/worker/tick", json=body).status_code == 401  # a user's token
    assert client.get(f"/v1/jobs/{refs[0]['job_id']}/logs").text == ""
    bad = client.post("/v1/worker/tick", json={"leases": [{"job_id": refs[0]["job_id"], "attempt": 0}]},
                      headers=running["mine"])
    assert bad.status_code == 422 and "attempt" in bad.text


def test_an_attempt_that_lost_its_job_is_told_so_while_the_others_are_renewed_and_stored(client, running):
    refs = running["refs"]
    with Session(running["engine"]) as db:  # the sweeper gave the first job back
        assert lifecycle.hand_back(db, job_id=refs[0]["job_id"], attempt=refs[0]["attempt"], detail="taken back")
        db.commit()
    body = {"leases": refs, "ships": [batch(refs[0], 1, text="too late\n", steps=range(1, 2)),
                                      batch(refs[1], 1, text="on time\n", steps=range(1, 2))]}
    answer = client.post("/v1/worker/tick", json=body, headers=running["mine"]).json()
    assert [lease["held"] is None for lease in answer["leases"]] == [True, False, False]
    assert answer["ships"] == [{"applied": False, "lost": True, "refused": None},
                               {"applied": True, "lost": False, "refused": None}]
    assert client.get(f"/v1/jobs/{refs[0]['job_id']}/logs").text == ""
    assert client.get(f"/v1/jobs/{refs[1]['job_id']}/logs").text == "on time\n"


def test_a_batch_the_database_refuses_is_refused_alone_and_the_others_are_stored(running, settings, postgres_url):
    if settings.resolved_database_url != postgres_url:
        pytest.skip("SQLite stores a NUL in text; PostgreSQL refuses it")
    refs = running["refs"]
    body = TickBody.model_validate({"leases": refs, "ships": [
        batch(refs[0], 1, text="a NUL \x00 the worker would have cut\n", steps=range(1, 2)),
        batch(refs[1], 1, text="fine\n", steps=range(1, 3))]})
    with Session(running["engine"]) as db:
        answer = tick(db, protocol.Context(protocol.TRUSTED, settings, None), body)
    assert answer.ships[0].refused and not answer.ships[0].applied
    assert answer.ships[1].applied and answer.ships[1].refused is None
    assert all(lease.held is not None for lease in answer.leases)
    again = running["control"].call("tick", {"ships": [batch(refs[1], 2, text="more\n", steps=range(3, 4), start=5)]})
    assert again["ships"] == [{"applied": True, "lost": False, "refused": None}]


def claimed(client, engine) -> dict:
    """One more job claimed by the fixture's worker."""
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    with Session(engine) as db:
        number, _ = lifecycle.claim(db, job_id=job_id, worker=WORKER, lease_s=60)
        db.commit()
    return {"job_id": job_id, "attempt": number, "node_rank": 0}


def stored(engine, job_id: str) -> dict:
    """Everything a job's batches wrote, as rows without their job (nor the ids the database gave them)."""
    with Session(engine) as db:
        return {
            "log": db.execute(select(LogChunk.attempt, LogChunk.node_rank, LogChunk.seq, LogChunk.start,
                                     LogChunk.length, LogChunk.text).where(LogChunk.job_id == job_id)
                              .order_by(LogChunk.id)).all(),
            "points": db.execute(select(Metric.attempt, Metric.node_rank, Metric.step, Metric.name, Metric.value,
                                        Metric.time).where(Metric.job_id == job_id).order_by(Metric.id)).all(),
            "blocks": [{f: getattr(b, f) for f in ("node_rank", "name", "block", "points", "last_step",
                                                   "last_value", "min_step", "min_value", "max_step", "max_value")}
                       for b in db.scalars(select(MetricBlock).where(MetricBlock.job_id == job_id)
                                           .order_by(MetricBlock.name, MetricBlock.block))],
            "progress": db.execute(text("SELECT CAST(progress AS text) FROM jobs WHERE id = :id"),
                                   {"id": job_id}).scalar(),
            "seq": db.execute(select(AttemptStream.attempt, AttemptStream.node_rank, AttemptStream.stream,
                                     AttemptStream.seq).where(AttemptStream.job_id == job_id)).all(),
        }


def rounds(ref: dict, n: int, at: float) -> list[dict]:
    """Two batches of the n-th job: points as rows then as columns, the second repeating a step of the first (a
    resumed attempt: its block recomputed), progress in each."""
    first = {**ref, "seq": 1, "log": {"start": 0, "seq": 1, "text": f"job {n} a\n"},
             "points": [[s, "loss", 1.0 / s, at] for s in range(1, 4 + n)],
             "progress": {"step": 3 + n, "total_steps": 300, "eta_s": None}}
    rows = [(s, name, (s * 7 + n) % 5 / 3, at + s) for s in range(3 + n, 300) for name in ("loss", f"lr{n}")]
    second = {**ref, "seq": 2, "log": {"start": len(f"job {n} a\n"), "seq": 2, "text": f"job {n} b ☃\n"},
              "points": PointColumns.of(rows).model_dump(mode="json"),
              "progress": {"step": 299, "total_steps": 300, "eta_s": 1.5, "performance": {"tok_s": 10.0 + n}}}
    return [first, second]


def test_a_tick_of_several_attempts_batches_stores_what_their_ships_store_and_once(client, running, settings):
    """The tick writes its batches together (one statement a part, service/runners/tick_calls.py): the rows are
    those the same batches store shipped one by one; sent again, it applies nothing."""
    engine, ticked = running["engine"], running["refs"]
    shipped = [claimed(client, engine) for _ in ticked]
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    at = time.time()
    for number in range(2):
        for n, ref in enumerate(shipped):
            one = client.post("/v1/worker/ship", json=rounds(ref, n, at)[number], headers=running["mine"])
            assert one.json() == {"applied": True, "lost": False}
        body = TickBody.model_validate({"ships": [rounds(ref, n, at)[number] for n, ref in enumerate(ticked)]})
        for sent in range(2):  # the second time: its answer was lost
            statements.clear()
            with Session(engine) as db:
                answer = tick(db, protocol.Context(protocol.TRUSTED, settings, None), body)
            assert [(a.applied, a.lost, a.refused) for a in answer.ships] == [(sent == 0, False, None)] * len(ticked)
            logged = [s for s in statements if s.lstrip().upper().startswith("INSERT INTO LOG_CHUNKS")]
            assert len(logged) == (sent == 0)  # the batches' chunks in one statement, and none sent again
    for mine, theirs in zip(ticked, shipped, strict=True):
        got, want = stored(engine, mine["job_id"]), stored(engine, theirs["job_id"])
        assert got == want
        assert len(got["points"]) > 500 and len(got["log"]) == 2 and got["seq"] == [(1, 0, "ship", 2)]
    assert stored(engine, ticked[0]["job_id"])["progress"] != stored(engine, ticked[1]["job_id"])["progress"]


@pytest.fixture
def relayed(client, running):
    """The worker's relay in front of the API (the TestClient, with gpu-7's credential), and a Control of a
    work-horse that reaches it."""
    api = ApiControl("http://testserver", "unused")
    api.client = client.__class__(client.app, headers=running["mine"])
    relay = Relay(api, window_s=0.3).start()
    yield relay, Relayed(api, relay.path)
    relay.stop()
    api.client.close()


def test_the_relay_sends_what_its_attempts_ship_and_renew_within_a_window_as_one_tick(client, running, relayed):
    relay, control = relayed
    refs, answers = running["refs"], {}

    def attempt(i: int) -> None:  # an attempt's supervisor (its ship) and its lease thread, in a work-horse
        answers[i] = (control.call("ship", batch(refs[i], 1, text=f"job {i}\n", steps=range(1, 3))),
                      control.call("leases", {"attempts": [refs[i]]}))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(3)]
    beat = threading.Thread(target=lambda: answers.update(beat=relay.beat(worker_id=WORKER, draining=False,
                                                                           pressure=None, devices=None)))
    for thread in [*threads, beat]:
        thread.start()
    for thread in [*threads, beat]:
        thread.join(30)
    assert answers["beat"] is True
    for i, ref in enumerate(refs):
        shipped, leases = answers[i]
        assert shipped == {"applied": True, "lost": False}
        assert [(lease["job_id"], lease["held"] is not None) for lease in leases["leases"]] == [(ref["job_id"], True)]
        assert client.get(f"/v1/jobs/{ref['job_id']}/logs").text == f"job {i}\n"
    assert relay.sent <= 3  # 3 ships, 3 renewals and a heartbeat: 7 calls in at most 3 ticks, a window apart

    relay.stop()  # the worker's main process gone: the work-horse calls the API itself
    again = control.call("ship", batch(refs[0], 1, text="job 0\n", steps=range(1, 3)))
    assert again == {"applied": False, "lost": False}
    assert client.get(f"/v1/jobs/{refs[0]['job_id']}/logs").text == "job 0\n"


def test_a_batch_refused_in_a_tick_is_refused_to_its_caller_alone(client, running, relayed, settings, postgres_url):
    if settings.resolved_database_url != postgres_url:
        pytest.skip("SQLite stores a NUL in text; PostgreSQL refuses it")
    _, control = relayed
    refs, got = running["refs"], {}

    def ship(i: int, text: str) -> None:
        try:
            got[i] = control.call("ship", batch(refs[i], 1, text=text, steps=range(1, 2)))
        except Refused as exc:
            got[i] = exc

    threads = [threading.Thread(target=ship, args=(0, "bad \x00\n")), threading.Thread(target=ship, args=(1, "ok\n"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert isinstance(got[0], Refused) and got[0].status == 422
    assert got[1] == {"applied": True, "lost": False}
    assert client.get(f"/v1/jobs/{refs[1]['job_id']}/logs").text == "ok\n"
