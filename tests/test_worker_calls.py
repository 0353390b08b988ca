"""The worker protocol's calls on an attempt's life (service/runners/attempt_calls.py), over HTTP with a worker
credential and in-process for a database worker: a call sent again after its answer was lost answers as the first
and moves nothing again; another runner's credential gets a 403, a user's token a 401, bad input a 422 naming the
field; and a joined worker's agent and lease go through them."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.jobs.models import Attempt, JobEvent
from service.workers import holds
from tests.conftest import mlp_spec
from tests.test_worker_join import as_worker, join, join_token
from trainjobs.states import JobStatus
from worker import agent
from worker.control import ApiControl, DatabaseControl, Refused
from worker.lease import Lease
from worker.supervisor import Outcome

CRASH = {"type": "process_exit", "message": "rank 0 got SIGKILL", "rank": 0}
GANG_SPEC = {"resources": {"nnodes": 2, "nproc_per_node": 1, "device": "cpu"}}
OFFER = {"device": "cpu", "slots": 2, "memory_bytes": 2**32, "labels": {}}


@pytest.fixture
def machines(client) -> tuple[dict, dict]:
    """Two joined machines' headers: gpu-7's and gpu-8's."""
    return tuple(as_worker(join(client, join_token(client), r).json()["credential"]) for r in ("gpu-7", "gpu-8"))


@pytest.fixture
def db(settings):
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as session:
        yield session
    engine.dispose()


def call(client, name: str, body: dict, headers: dict) -> dict | None:
    answer = client.post(f"/v1/worker/{name}", json=body, headers=headers)
    assert answer.status_code in (200, 204), answer.text
    return answer.json() if answer.status_code == 200 else None


def attempts_of(db: Session, job_id: str) -> list[tuple[int, int, str, str]]:
    db.expire_all()
    return db.execute(select(Attempt.number, Attempt.node_rank, Attempt.worker, Attempt.status)
                      .where(Attempt.job_id == job_id).order_by(Attempt.number, Attempt.node_rank)).all()


def events(db: Session, job_id: str, kind: str) -> int:
    return db.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id,
                                                                      JobEvent.kind == kind))


def test_a_claim_sent_again_gets_the_same_attempt_and_another_workers_claim_gets_none(client, machines, db):
    gpu7, gpu8 = machines
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    first = call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)
    again = call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)  # its answer was lost
    assert first["claimed"] and first["attempt"] == 1 and first["spec"]["name"] == "mlp-ddp"
    assert again == first
    for worker, headers in (("gpu-8-1", gpu8), ("gpu-7-6", gpu7)):  # another machine; another process of gpu-7
        other = call(client, "claim", {"job_id": job_id, "worker_id": worker}, headers)
        assert not other["claimed"] and "starting" in other["why"] and other["attempt"] is None
    assert attempts_of(db, job_id) == [(1, 0, "gpu-7-5", "active")]
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "starting"
    assert events(db, job_id, "starting") == 1
    gone = call(client, "claim", {"job_id": "0123456789abcdef0123", "worker_id": "gpu-7-5"}, gpu7)
    assert not gone["claimed"] and "not there" in gone["why"]


def test_a_second_lane_of_the_worker_is_not_handed_the_attempt_its_sibling_bound(client, machines, db):
    """Lanes of one worker share its id: once the attempt's devices are bound, a claim is no replay any more."""
    gpu7, _ = machines
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    assert holds.take(db, worker_id="gpu-7-5", job_id=job_id, node_rank=0, devices=[0, 1])
    claim = {"job_id": job_id, "worker_id": "gpu-7-5"}
    assert call(client, "claim", claim, gpu7)["attempt"] == 1
    ref = {"job_id": job_id, "attempt": 1, "node_rank": 0, "worker_id": "gpu-7-5"}
    assert call(client, "bind", ref, gpu7) == {"devices": [0, 1]}
    assert call(client, "bind", ref, gpu7) == {"devices": [0, 1]}  # a replay binds the same
    assert not call(client, "claim", claim, gpu7)["claimed"]
    call(client, "free", {"job_id": job_id, "worker_id": "gpu-7-5", "node_rank": 0}, gpu7)
    call(client, "free", {"job_id": job_id, "worker_id": "gpu-7-5", "node_rank": 0}, gpu7)
    db.expire_all()
    assert holds.held(db, worker_id="gpu-7-5") == {}


def test_an_outcome_sent_again_settles_the_attempt_once_and_spends_one_retry(client, machines, db):
    gpu7, _ = machines
    job_id = client.post("/v1/jobs", json=mlp_spec(max_retries=1)).json()["id"]
    call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)
    ref = {"job_id": job_id, "attempt": 1, "node_rank": 0}
    for _ in range(2):
        assert call(client, "running", {**ref, "detail": "torchrun pid 41"}, gpu7) == {"running": True}
    assert events(db, job_id, "running") == 1
    failed = {**ref, "status": "failed", "exit_code": -9, "error": CRASH}
    first = call(client, "outcome", failed, gpu7)
    again = call(client, "outcome", failed, gpu7)
    assert first == again == {"recorded": True, "job_status": "queued"}
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and [a["attempt"] for a in job["error"]["attempts"]] == [1]
    assert [(a["number"], a["status"]) for a in client.get(f"/v1/jobs/{job_id}/attempts").json()["data"]] == \
        [(1, "failed")]
    assert events(db, job_id, "queued") == 2  # its submission, and one retry: not two
    other = call(client, "outcome", {**failed, "exit_code": 1}, gpu7)  # not what was recorded: the job moved on
    assert other == {"recorded": False, "job_status": "queued"}
    assert call(client, "running", {**ref, "detail": "late"}, gpu7) == {"running": False}


def test_a_success_and_a_hand_back_sent_again_are_recorded_once(client, machines, db):
    gpu7, _ = machines
    done, back = (client.post("/v1/jobs", json=mlp_spec()).json()["id"] for _ in range(2))
    for job_id in (done, back):
        call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)
        call(client, "running", {"job_id": job_id, "attempt": 1, "detail": "torchrun pid 41"}, gpu7)
    succeeded = {"job_id": done, "attempt": 1, "status": "succeeded", "exit_code": 0, "summary": {"loss": 0.1}}
    for _ in range(2):
        assert call(client, "outcome", succeeded, gpu7) == {"recorded": True, "job_status": "succeeded"}
    assert events(db, done, "succeeded") == 1
    assert client.get(f"/v1/jobs/{done}").json()["summary"] == {"loss": 0.1}
    handed = {"job_id": back, "attempt": 1, "status": "queued", "detail": "worker shutting down"}
    for _ in range(2):
        assert call(client, "outcome", handed, gpu7) == {"recorded": True, "job_status": "queued"}
    assert events(db, back, "queued") == 2  # its submission, and the hand-back once
    assert attempts_of(db, back) == [(1, 0, "gpu-7-5", "preempted")]


def test_a_gang_forms_through_the_calls_and_each_replay_answers_the_same(client, machines, db, redis, settings):
    gpu7, gpu8 = machines
    job_id = client.post("/v1/jobs", json=mlp_spec(**GANG_SPEC)).json()["id"]
    assert call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)["attempt"] == 1
    # A replay answers the same attempt. (Node 1's task is the scheduling pass's to hand, to the worker it assigned.)
    assert call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)["attempt"] == 1
    node1 = {"job_id": job_id, "attempt": 1, "node_rank": 1}
    for _ in range(2):
        joined = call(client, "gang_join", {**node1, "worker_id": "gpu-8-1"}, gpu8)
        assert joined["joined"] and joined["spec"]["resources"]["nnodes"] == 2
    assert not call(client, "gang_join", {**node1, "worker_id": "gpu-7-6"}, gpu7)["joined"]  # the node is taken
    assert events(db, job_id, "node_joined") == 1
    look1 = {**node1, "worker_id": "gpu-8-1", "offer": OFFER}
    assert call(client, "gang_check", look1, gpu8) == {"state": "waiting", "endpoint": None}
    look0 = {"job_id": job_id, "attempt": 1, "node_rank": 0, "worker_id": "gpu-7-5", "offer": OFFER,
             "endpoint": "10.0.0.7:29511"}
    assert call(client, "gang_check", look0, gpu7) == {"state": "formed", "endpoint": "10.0.0.7:29511"}
    # node 0 proposes another port at each look: a replay still gets the endpoint the gang formed at
    assert call(client, "gang_check", {**look0, "endpoint": "10.0.0.7:40000"}, gpu7)["endpoint"] == "10.0.0.7:29511"
    assert call(client, "gang_check", look1, gpu8) == {"state": "formed", "endpoint": "10.0.0.7:29511"}
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
    assert events(db, job_id, "running") == 1


def test_a_gang_released_twice_is_queued_once_and_spends_no_retry(client, machines, db):
    gpu7, _ = machines
    job_id = client.post("/v1/jobs", json=mlp_spec(max_retries=0, **GANG_SPEC)).json()["id"]
    call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)
    release = {"job_id": job_id, "attempt": 1, "node_rank": 0, "why": "node 0's worker is shutting down"}
    for _ in range(2):
        assert call(client, "gang_release", release, gpu7) == {"released": True}
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "queued" and "shutting down" in job["pending_reason"]
    assert events(db, job_id, "queued") == 2 and attempts_of(db, job_id) == [(1, 0, "gpu-7-5", "preempted")]
    other = call(client, "gang_release", {**release, "why": "another reason"}, gpu7)
    assert other == {"released": False}


def test_another_runners_credential_gets_403_and_a_users_token_401(client, machines):
    gpu7, gpu8 = machines
    job_id = client.post("/v1/jobs", json=mlp_spec(**GANG_SPEC)).json()["id"]
    call(client, "claim", {"job_id": job_id, "worker_id": "gpu-7-5"}, gpu7)
    ref = {"job_id": job_id, "attempt": 1, "node_rank": 0}
    mine = {"worker_id": "gpu-7-5"}
    calls = {
        "claim": {"job_id": job_id, **mine},
        "bind": {**ref, **mine},
        "free": {"job_id": job_id, **mine},
        "phase": {**ref, "phase": "launching"},
        "running": {**ref, "detail": "torchrun pid 41"},
        "leases": {"attempts": [ref]},
        "outcome": {**ref, "status": "failed", "error": CRASH},
        "gang_join": {**ref, "node_rank": 1, **mine},
        "gang_check": {**ref, **mine, "offer": OFFER, "endpoint": "10.0.0.8:29500"},
        "gang_release": {**ref, "why": "stealing"},
    }
    for name, body in calls.items():
        refused = client.post(f"/v1/worker/{name}", json=body, headers=gpu8)
        assert refused.status_code == 403 and "gpu-8" in refused.json()["detail"], (name, refused.text)
        assert client.post(f"/v1/worker/{name}", json=body).status_code == 401, name  # the admin's own token
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "starting"  # nothing moved


@pytest.mark.parametrize(("name", "body", "field"), [
    ("claim", {"job_id": "x" * 33, "worker_id": "gpu-7-5"}, "job_id"),
    ("claim", {"job_id": "j", "worker_id": "../etc"}, "worker_id"),
    ("bind", {"job_id": "j", "attempt": 0, "worker_id": "gpu-7-5"}, "attempt"),
    ("free", {"job_id": "j", "worker_id": "gpu-7-5", "node_rank": -1}, "node_rank"),
    ("running", {"job_id": "j", "attempt": 1, "node_rank": 5000, "detail": "x"}, "node_rank"),
    ("outcome", {"job_id": "j", "attempt": 1, "status": "exploded"}, "status"),
    ("outcome", {"job_id": "j", "attempt": 1, "status": "failed", "exit_code": 2**40}, "exit_code"),
    ("gang_join", {"job_id": "j", "attempt": 1, "node_rank": 0, "worker_id": "gpu-7-5"}, "node_rank"),
    ("gang_check", {"job_id": "j", "attempt": 1, "worker_id": "gpu-7-5", "offer": {**OFFER, "slots": 0}}, "slots"),
    ("gang_check", {"job_id": "j", "attempt": 1, "worker_id": "gpu-7-5", "offer": OFFER}, "endpoint"),
    ("gang_check", {"job_id": "j", "attempt": 1, "worker_id": "gpu-7-5", "offer": OFFER, "endpoint": "x"},
     "endpoint"),
    ("leases", {"attempts": [{"job_id": "j", "attempt": "one"}]}, "attempt"),
])
def test_bad_input_to_a_call_is_a_422_naming_the_field(client, machines, name, body, field):
    answer = client.post(f"/v1/worker/{name}", json=body, headers=machines[0])
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]  # pydantic's errors, each at its location; or the handler's, naming its field
    named = {str(e["loc"][-1]) for e in detail} if isinstance(detail, list) else {answer.json()["field"]}
    assert field in named, answer.text


def test_a_database_worker_runs_the_same_calls_in_process(client, settings, db, monkeypatch):
    """The agent and the lease of a worker that holds the database's URL: a claim replayed, a lease renewed with
    what the job asks, an outcome recorded once, a bad body refused as the API would."""
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", "db-worker")
    engine = create_engine(settings.resolved_database_url)
    control = DatabaseControl(sessionmaker(engine), settings)
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    attempt, spec = agent.claim(control, job_id=job_id)
    assert (attempt, spec.name) == (1, "mlp-ddp") and agent.claim(control, job_id=job_id)[0] == 1
    lease = Lease(control, settings, job_id=job_id, attempt=1)
    assert lease.renew() and lease.held.cancel_requested is False
    client.post(f"/v1/jobs/{job_id}/cancel")
    assert lease.renew() and lease.held.cancel_requested is True
    for _ in range(2):
        agent.record(control, job_id=job_id, attempt=1, outcome=Outcome(JobStatus.CANCELLED, -15))
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    assert events(db, job_id, "cancelled") == 1
    assert not lease.renew() and lease.lost  # the attempt ended: its lease holds nothing
    with pytest.raises(Refused) as refused:
        control.call("outcome", {"job_id": job_id, "attempt": 1, "status": "exploded"})
    assert refused.value.status == 422 and "status" in refused.value.detail
    engine.dispose()


def test_a_joined_workers_agent_and_lease_go_through_the_api(client, settings, db, monkeypatch):
    """ApiControl over the app (a TestClient as its HTTP client): the agent claims, binds, records; the lease is
    renewed until the machine's credential is revoked, which the API answers by taking its jobs back."""
    credential = join(client, join_token(client), "gpu-7").json()["credential"]
    control = ApiControl("http://testserver", credential)
    control.client = TestClient(client.app, headers=as_worker(credential))
    monkeypatch.setenv("TRAINJOBS_WORKER_NAME", "gpu-7-5")
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    attempt, _ = agent.claim(control, job_id=job_id)
    lease = Lease(control, settings, job_id=job_id, attempt=attempt)
    assert lease.renew() and not lease.lost
    client.post("/v1/runners/gpu-7/revoke")
    assert not lease.renew() and lease.lost
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"  # the API handed it back
