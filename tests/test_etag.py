"""ETags on job reads: a poller that sends If-None-Match gets 304 until the job changes."""

from tests.conftest import mlp_spec


def test_job_read_has_a_strong_etag_and_a_matching_if_none_match_is_304_without_body(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    first = client.get(f"/v1/jobs/{job['id']}")
    etag = first.headers["etag"]
    assert first.status_code == 200 and etag.startswith('"') and not etag.startswith("W/")
    assert client.get(f"/v1/jobs/{job['id']}").headers["etag"] == etag  # stable while nothing changes
    again = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    listed = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": f'"other", W/{etag}'})
    assert listed.status_code == 304


def test_a_changed_job_gets_a_new_etag_and_a_full_answer(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    etag = client.get(f"/v1/jobs/{job['id']}").headers["etag"]
    client.post(f"/v1/jobs/{job['id']}/cancel")
    r = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.headers["etag"] != etag


def test_job_list_has_an_etag_that_changes_with_a_new_job(client):
    client.post("/v1/jobs", json=mlp_spec())
    etag = client.get("/v1/jobs").headers["etag"]
    assert client.get("/v1/jobs", headers={"If-None-Match": etag}).status_code == 304
    client.post("/v1/jobs", json=mlp_spec())
    r = client.get("/v1/jobs", headers={"If-None-Match": etag})
    assert r.status_code == 200 and len(r.json()["items"]) == 2


def test_unknown_job_is_still_404_with_an_if_none_match(client):
    assert client.get("/v1/jobs/0123456789abcdef0123", headers={"If-None-Match": "*"}).status_code == 404
