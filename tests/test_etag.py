"""ETags on job reads: a poller that sends If-None-Match gets 304 until the job changes."""

import time

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.db import utcnow
from service.jobs import lifecycle, records
from service.jobs import service as jobs
from service.jobs.models import Job
from service.jobs.schemas import JobPublic, JobsPublic
from service.logs import service as logs
from service.metrics import service as metrics
from tests.conftest import admin_token, mlp_spec
from trainjobs.spec import JobSpec
from trainjobs.states import JobStatus


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


def etag(client, job_id: str) -> str:
    r = client.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200
    return r.headers["etag"]


def test_a_job_etag_changes_with_every_change_of_the_job_and_never_otherwise(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    other = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = create_engine(settings.database_url)
    seen = [etag(client, job_id)]

    def changed() -> str:
        now = etag(client, job_id)
        assert now not in seen, "a change of the job kept an ETag it had before"
        seen.append(now)
        return now

    def unchanged() -> None:
        assert etag(client, job_id) == seen[-1]

    with Session(engine) as db:
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker="w0", lease_s=30)
        db.commit()
    changed()  # queued → starting
    with Session(engine) as db:
        assert lifecycle.start_running(db, job_id=job_id, attempt=attempt, detail="launched")
        db.commit()
    changed()  # → running
    for step in (5, 10):
        with Session(engine) as db:
            records.record_progress(db, job_id=job_id, attempt=attempt, progress={"step": step})
            db.commit()
        assert client.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == step
        changed()
    with Session(engine) as db:  # what a supervisor does between progress reports touches other rows only
        assert lifecycle.hold(db, job_id=job_id, attempt=attempt, node_rank=0, lease_s=30) is not None
        metrics.insert_batch(db, job_id=job_id, attempt=attempt, rows=[(10, "loss", 0.5, utcnow())])
        logs.append(db, job_id=job_id, attempt=attempt, start=0, seq=0, text="step 10\n")
        db.commit()
    unchanged()
    client.post(f"/v1/jobs/{other}/cancel")  # another job's change
    client.get(f"/v1/jobs/{job_id}/metrics")
    unchanged()
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["cancel_requested_at"] is not None
    changed()  # the cancel request
    client.post(f"/v1/jobs/{job_id}/cancel")  # asked again: nothing changes
    unchanged()
    with Session(engine) as db:
        assert lifecycle.finish_node(db, job_id=job_id, attempt=attempt, node_rank=0, status=JobStatus.CANCELLED,
                                     summary={"steps": 10}, error=None, exit_code=-15)
        db.commit()
    last = changed()  # → cancelled, with its summary
    assert client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": last}).status_code == 304
    engine.dispose()


def test_any_update_of_a_job_row_bumps_its_version_even_one_written_by_hand(db_url):
    engine = create_engine(db_url)
    with Session(engine) as db:
        job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
        db.commit()
        version = db.scalar(select(Job.version).where(Job.id == job_id))
        db.execute(text("UPDATE jobs SET name = 'renamed', version = 7 WHERE id = :id"), {"id": job_id})
        db.commit()
        assert db.scalar(select(Job.version).where(Job.id == job_id)) == version + 1
    engine.dispose()


def test_a_304_answers_the_same_etag_as_the_200_and_the_same_version_the_same_bytes(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    first, second = client.get(f"/v1/jobs/{job_id}"), client.get(f"/v1/jobs/{job_id}")
    assert first.content == second.content and first.headers["etag"] == second.headers["etag"]
    cached = client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": first.headers["etag"]})
    assert cached.status_code == 304 and cached.headers["etag"] == first.headers["etag"]
    assert cached.headers["cache-control"] == "no-cache"


def test_someone_elses_job_is_a_404_even_with_a_matching_if_none_match(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    tag = etag(client, job_id)
    secret = client.post("/v1/tokens", json={"name": "bob"}).json()["token"]
    r = client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": tag, "Authorization": f"Bearer {secret}"})
    assert r.status_code == 404


def test_a_list_answers_the_bytes_pydantic_would_write_from_rendered_and_fresh_jobs_alike(settings, redis):
    # One sweeper pass at the start, none after: a pending reason it wrote between the list and the fresh read
    # below would be a new version of a job (CI caught that race once).
    settings = settings.model_copy(update={"sweep_s": 3600})
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        time.sleep(1)  # the start's pass is over
        ids = [client.post("/v1/jobs", json=mlp_spec(name=f"j{i}")).json()["id"] for i in range(3)]
        client.get(f"/v1/jobs/{ids[1]}")  # one of them rendered (and kept) already
        client.post(f"/v1/jobs/{ids[2]}/cancel")  # one changed since
        got = client.get("/v1/jobs", params={"limit": 2})
    engine = create_engine(settings.database_url)
    with Session(engine) as db:
        page, cursor = jobs.list_page(db, limit=2)
        expected = JobsPublic(items=[JobPublic.of(jobs.get(db, job_id=row.id)) for row in page], next_cursor=cursor)
    engine.dispose()
    assert got.content == expected.model_dump_json().encode()
    assert [item["id"] for item in got.json()["items"]] == [ids[2], ids[1]] and got.json()["next_cursor"] == ids[1]
    assert got.json()["items"][0]["status"] == "cancelled"


def test_a_job_read_after_a_change_is_the_new_body_not_the_one_kept(client):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    before = client.get(f"/v1/jobs/{job_id}")
    assert client.get(f"/v1/jobs/{job_id}").content == before.content  # the kept body
    client.post(f"/v1/jobs/{job_id}/cancel")
    after = client.get(f"/v1/jobs/{job_id}")
    assert after.json()["status"] == "cancelled" and after.headers["etag"] != before.headers["etag"]


def test_a_submission_answers_with_the_etag_and_the_bytes_of_the_jobs_read(settings, redis):
    # One sweeper pass at the start, none after (it would write the pending reason: a new version).
    settings = settings.model_copy(update={"sweep_s": 3600})
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        time.sleep(1)  # the start's pass is over
        created = client.post("/v1/jobs", json=mlp_spec(), headers={"Idempotency-Key": "k1"})
        assert created.status_code == 201 and created.headers["location"] == f"/v1/jobs/{created.json()['id']}"
        assert created.headers["content-type"] == "application/json"
        read = client.get(created.headers["location"])
        assert read.headers["etag"] == created.headers["etag"] and read.content == created.content
        assert JobPublic.model_validate_json(created.content).status == "queued"
        polled = client.get(created.headers["location"], headers={"If-None-Match": created.headers["etag"]})
        assert polled.status_code == 304
        again = client.post("/v1/jobs", json=mlp_spec(), headers={"Idempotency-Key": "k1"})  # a retry: the same job
        assert again.status_code == 200 and again.content == created.content
        assert again.headers["etag"] == created.headers["etag"]
