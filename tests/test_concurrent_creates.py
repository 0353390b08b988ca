"""Create-if-absent at once: callers that race to make the same thing (a package, a token's new user, a job by
its Idempotency-Key) each get their answer, the same one, and none a 500; on SQLite and PostgreSQL."""

import threading
from concurrent.futures import ThreadPoolExecutor

from service.packages import service as packages
from tests.conftest import mlp_spec
from tests.test_packages import packing_digest, project, put
from trainjobs.packing import pack

N = 6  # callers at once


def at_once(n: int, call):
    """`call(i)` from n threads released together: their answers, in order."""
    start = threading.Barrier(n)

    def run(i: int):
        start.wait(timeout=30)
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def test_uploads_of_one_package_at_once_all_answer_with_it(client, settings, tmp_path, monkeypatch):
    """`trainjobs run` of one folder N times at once: every upload finds no package before any keeps one (the
    worst order, made sure of by a barrier in the lookup), then one is new (201) and the rest have it (200)."""
    with pack(project(tmp_path / "p")) as packed:
        body = packed.path.read_bytes()
    looked = threading.Barrier(N)
    find = packages.find

    def find_together(db, **where):
        found = find(db, **where)
        try:
            looked.wait(timeout=10)  # every caller has looked (and found nothing) before any goes on
        except threading.BrokenBarrierError:
            pass
        return found

    monkeypatch.setattr(packages, "find", find_together)
    answers = at_once(N, lambda _: put(client, body))
    assert sorted(r.status_code for r in answers) == [200] * (N - 1) + [201], [r.text for r in answers]
    assert {r.json()["digest"] for r in answers} == {packing_digest(body)}
    listing = client.get("/v1/packages").json()
    assert listing["count"] == 1 and listing["items"][0]["size"] == len(body)


def test_submits_with_one_idempotency_key_at_once_make_one_job(client):
    answers = at_once(N, lambda _: client.post("/v1/jobs", json=mlp_spec(), headers={"Idempotency-Key": "once"}))
    assert sorted(r.status_code for r in answers) == [200] * (N - 1) + [201], [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert len(client.get("/v1/jobs").json()["items"]) == 1


def test_tokens_for_a_new_user_at_once_each_make_a_token_of_that_user(client):
    """`trainjobs token create` for a user who has none, twice at once (two laptops): two tokens, one user."""
    answers = at_once(N, lambda i: client.post("/v1/tokens", json={"name": f"laptop-{i}", "user": "newcomer"}))
    assert [r.status_code for r in answers] == [201] * N, [r.text for r in answers]
    assert {r.json()["user"] for r in answers} == {"newcomer"}
    assert len({r.json()["token"] for r in answers}) == N
