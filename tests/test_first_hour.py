"""The first hour (issue 36): what a new user sees is true and says what is going on."""

from sqlalchemy import update

from service.db import make_engine
from service.jobs.models import Job
from tests.conftest import mlp_spec


def test_a_job_that_ended_shows_no_eta(client, settings):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = make_engine(settings.database_url)
    with engine.begin() as conn:  # as a supervisor left it: its last progress, then the job failed
        conn.execute(update(Job).where(Job.id == job_id).values(
            status="failed", progress={"step": 5, "total_steps": 20, "eta_s": 12.5}))
    engine.dispose()
    progress = client.get(f"/v1/jobs/{job_id}").json()["progress"]
    assert progress == {"step": 5, "total_steps": 20, "eta_s": None}


def test_the_follow_bar_says_why_a_queued_job_waits():
    from service.cli.follow import ProgressView
    from trainjobs.client import Event

    view = ProgressView({"status": "queued", "progress": {"step": 0, "total_steps": 20},
                         "pending_reason": "no live worker fits (needs 8 processes per node; the largest has 2)"})
    assert view.fields()["status"] == "queued: no live worker fits (needs 8 processes per node; the largest has 2)"
    view.apply(Event(kind="status", data={"status": "running", "pending_reason": None}, id="1"))
    assert view.fields()["status"] == "running"
