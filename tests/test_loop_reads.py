"""A job's read on the event loop's own PostgreSQL connections (service/api/loop_reads.py): the answers of the
threadpool's session, on a new connection when the server ended the old ones, a 503 while it is away."""

import pytest
from sqlalchemy import create_engine, text

from service.api.loop_reads import APPLICATION_NAME
from tests.conftest import _empty_tables, mlp_spec


@pytest.fixture
def db_url(postgres_url):
    """PostgreSQL only: SQLite has no loop connections (its reads keep the threadpool; test_etag covers both)."""
    _empty_tables(postgres_url)
    return postgres_url


def end_loop_connections(url: str) -> int:
    """As a server restart or an operator's pg_terminate_backend would: how many it ended."""
    engine = create_engine(url)
    with engine.begin() as conn:
        ended = conn.execute(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                  "WHERE application_name = :name AND datname = current_database()"),
                             {"name": APPLICATION_NAME}).scalar_one()
    engine.dispose()
    return ended


def test_a_job_read_goes_on_after_the_server_ended_the_loops_connection(client, db_url):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    first = client.get(f"/v1/jobs/{job_id}")
    assert first.status_code == 200 and first.json()["id"] == job_id
    assert end_loop_connections(db_url) == 1  # the read ran on the loop's connection, now gone
    again = client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.headers["etag"] == first.headers["etag"]
    assert client.get(f"/v1/jobs/{job_id}").json() == first.json()


def test_a_job_read_is_a_503_to_retry_while_the_database_is_out_of_reach(client, db_url):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    client.get(f"/v1/jobs/{job_id}")
    reads = client.app.state.loop_reads
    good = reads.conninfo
    reads.conninfo = good.replace(good.split("@", 1)[1].split("/", 1)[0], "127.0.0.1:1")  # nothing listens there
    end_loop_connections(db_url)
    try:
        r = client.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 503 and r.headers["Retry-After"] and "unreachable" in r.json()["detail"]
    finally:
        reads.conninfo = good
    assert client.get(f"/v1/jobs/{job_id}").status_code == 200


def test_someone_elses_job_and_an_unknown_one_are_the_same_404_on_the_loop(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    token = client.post("/v1/tokens", json={"name": "b", "user": "bob"}).json()["token"]
    as_bob = {"Authorization": f"Bearer {token}"}
    theirs = client.get(f"/v1/jobs/{job_id}", headers=as_bob)
    unknown = client.get("/v1/jobs/0123456789abcdef0123", headers=as_bob)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["detail"].replace(job_id, "X") == unknown.json()["detail"].replace("0123456789abcdef0123", "X")
    assert client.get("/v1/jobs/" + "a" * 65).status_code == 404
