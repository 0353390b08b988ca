"""GET /v1/workers a page at a time, filtered in SQL (issue 42), on both databases: every worker once, each filter,
and a user sees only their own jobs' ids, as before the pages."""

import json
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Worker
from tests.conftest import mlp_spec
from tests.test_auth import make_token
from trainjobs.client import Client

N = 23


def device_rows(n: int, unhealthy: tuple[int, ...] = ()) -> list[dict]:
    return [{"index": d, "uuid": f"GPU-{d}", "memory_bytes": 2**30, "healthy": d not in unhealthy, "numa_node": 0,
             "cores": [d], "reason": "Xid 79" if d in unhealthy else None} for d in range(n)]


@pytest.fixture
def pool(client, settings):
    """N workers of 4 devices: w00..w22. Labels zone=a|b|c (i % 3) and gpu=h100 on even i; w03 lost; w05 draining;
    w07 has its device 3 unhealthy; w01 holds devices 0-1 for alice's job and 2 for the admin's; w02 every device
    for the admin's (busy); w04 lists no devices (an earlier version: 4 slots, 1 busy)."""
    mine = client.post("/v1/jobs", json=mlp_spec(name="admins")).json()["id"]
    alice = make_token(settings, "alice")
    theirs = client.post("/v1/jobs", json=mlp_spec(name="alices"),
                         headers={"Authorization": f"Bearer {alice}"}).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        for i in range(N):
            labels = {"zone": "abc"[i % 3], **({"gpu": "h100"} if i % 2 == 0 else {})}
            workers.register(db, worker_id=f"w{i:02d}", host=f"h{i}", address=f"10.0.0.{i}", device="cuda", slots=4,
                             memory_bytes=2**30, host_memory_bytes=2**34, labels=labels, max_jobs=4,
                             devices=None if i == 4 else device_rows(4, unhealthy=(3,) if i == 7 else ()))
        for worker, device, job in (("w01", 0, theirs), ("w01", 1, theirs), ("w01", 2, mine),
                                    *(("w02", d, mine) for d in range(4))):  # pending holds: live for a while
            assert holds.take(db, worker_id=worker, job_id=job, node_rank=0, devices=[device])
        for worker in ("w01", "w02"):
            holds.sync_worker(db, worker_id=worker)
        db.execute(update(Worker).where(Worker.id == "w03").values(last_seen=utcnow() - timedelta(hours=0.5)))
        db.execute(update(Worker).where(Worker.id == "w04").values(busy_slots=1))
        db.execute(update(Worker).where(Worker.id == "w05").values(state="draining"))
        db.commit()
    engine.dispose()
    return {"mine": mine, "theirs": theirs, "alice": alice}


def ids(client, **params) -> list[str]:
    body = client.get("/v1/workers", params=params)
    assert body.status_code == 200, body.text
    return [w["id"] for w in body.json()["items"]]


def test_pages_walk_every_worker_exactly_once_in_id_order(client, pool):
    seen, cursor, pages = [], None, 0
    while True:
        body = client.get("/v1/workers", params={"limit": 5, **({"cursor": cursor} if cursor else {})}).json()
        seen += [w["id"] for w in body["items"]]
        pages += 1
        assert len(body["items"]) == 5 or body["next_cursor"] is None
        if not (cursor := body["next_cursor"]):
            break
    assert seen == [f"w{i:02d}" for i in range(N)] and pages == 5
    assert client.get("/v1/workers").json()["next_cursor"] is None  # one page by default at this size
    # A page exactly full says there is no next page only when there is none.
    assert client.get("/v1/workers", params={"limit": N}).json()["next_cursor"] is None
    assert client.get("/v1/workers", params={"limit": N - 1}).json()["next_cursor"] == f"w{N - 2:02d}"


def test_state_filters_as_the_list_shows_the_state(client, pool):
    shown = {w["id"]: w["state"] for w in client.get("/v1/workers").json()["items"]}
    assert shown["w01"] == shown["w02"] == "busy" and shown["w03"] == "lost" and shown["w05"] == "draining"
    for state in ("idle", "busy", "draining", "lost"):
        assert ids(client, state=state) == sorted(w for w, s in shown.items() if s == state), state
    assert ids(client, state=["lost", "draining"]) == ["w03", "w05"]
    assert client.get("/v1/workers", params={"state": "gone"}).status_code == 422


def test_labels_filter_on_every_pair_given(client, pool):
    assert ids(client, label="zone=b") == [f"w{i:02d}" for i in range(N) if i % 3 == 1]
    assert ids(client, label=["zone=b", "gpu=h100"]) == [f"w{i:02d}" for i in range(N) if i % 3 == 1 and i % 2 == 0]
    assert ids(client, label="zone=z") == []
    refused = client.get("/v1/workers", params={"label": "zone"})
    assert refused.status_code == 422 and "label" in refused.text


def test_min_free_devices_counts_healthy_devices_no_live_hold_takes(client, pool):
    free = {w["id"]: sum(d["state"] == "free" for d in w["devices"]) if w["devices"] else w["slots"] - w["busy_slots"]
            for w in client.get("/v1/workers").json()["items"]}
    assert free["w01"] == 1 and free["w02"] == 0 and free["w04"] == 3 and free["w07"] == 3 and free["w00"] == 4
    for n in (1, 3, 4):
        assert ids(client, min_free_devices=n) == sorted(w for w, f in free.items() if f >= n), n
    combined = ids(client, state="idle", label="gpu=h100", min_free_devices=4, limit=2)
    assert combined == [w for w in sorted(free) if w not in ("w02", "w03", "w04") and int(w[1:]) % 2 == 0][:2]


def test_a_user_sees_only_their_own_jobs_on_the_workers_page(client, pool):
    as_alice = {"Authorization": f"Bearer {pool['alice']}"}
    body = client.get("/v1/workers", params={"cursor": "w00", "limit": 2}, headers=as_alice).json()
    w01, w02 = body["items"]
    assert w01["jobs"] == [pool["theirs"]] and [d["job"] for d in w01["devices"]] == [pool["theirs"]] * 2 + [None] * 2
    assert [d["state"] for d in w01["devices"]] == ["held", "held", "held", "free"]  # held, by whom it does not say
    assert w02["jobs"] == [] and w02["current_job"] is None and w02["busy_slots"] == 4
    admin = {w["id"]: w for w in client.get("/v1/workers", params={"limit": 3}).json()["items"]}
    assert admin["w01"]["jobs"] == sorted([pool["mine"], pool["theirs"]]) and admin["w02"]["jobs"] == [pool["mine"]]


def test_the_sdk_follows_the_pages_and_passes_the_filters(client, pool):
    sdk = Client("http://testserver", token="unused")
    sdk.http = client  # the TestClient is an httpx.Client on the app, carrying the admin token
    every = sdk.workers()
    assert [w["id"] for w in every["items"]] == [f"w{i:02d}" for i in range(N)] and every["next_cursor"] is None
    assert [w["id"] for w in sdk.iter_workers(page_size=4)] == [f"w{i:02d}" for i in range(N)]
    assert [w["id"] for w in sdk.workers(["lost", "draining"])["items"]] == ["w03", "w05"]
    assert [w["id"] for w in sdk.workers(labels={"zone": "b", "gpu": "h100"}, min_free_devices=4)["items"]] == [
        f"w{i:02d}" for i in range(N) if i % 3 == 1 and i % 2 == 0 and i != 4]  # w04: 3 free
    page = sdk.workers(limit=2, cursor="w20")
    assert [w["id"] for w in page["items"]] == ["w21", "w22"] and page["next_cursor"] is None


def test_the_cli_lists_every_worker_the_filters_pass(client, pool, capsys):
    from service.cli import main as cli

    def listed(*argv: str) -> list[str]:
        sdk = Client("http://testserver", token="unused")
        sdk.http = client
        args = cli.build_parser().parse_args(["workers", "--json", *argv])
        assert args.remote(args, sdk) == 0
        return [w["id"] for w in json.loads(capsys.readouterr().out)["items"]]

    assert listed() == [f"w{i:02d}" for i in range(N)]
    assert listed("--state", "lost", "--state", "draining") == ["w03", "w05"]
    assert listed("--label", "zone=b", "--label", "gpu=h100", "--free", "4") == ["w10", "w16", "w22"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["workers", "--label", "zone"])
