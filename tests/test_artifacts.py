"""A job's artifacts over HTTP: listed, downloaded, and never a path outside the job's folder."""

import os
from datetime import datetime, timedelta

import pytest

from service.artifacts import service as storage
from tests.conftest import mlp_spec


@pytest.fixture
def job_with_files(client, settings, tmp_path):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    root = storage.artifacts_dir(settings, job["id"])
    (root / "plots").mkdir(parents=True)
    (root / "model.pt").write_bytes(b"\x00weights\xff")
    (root / "plots" / "loss.csv").write_text("step,loss\n1,0.5\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (root / "escape").symlink_to(secret)  # a link out of the folder is neither listed nor served
    return job["id"]


def test_artifacts_are_listed_with_their_sizes(client, job_with_files):
    body = client.get(f"/v1/jobs/{job_with_files}/artifacts").json()
    assert body["count"] == 2
    assert [(f["name"], f["size"]) for f in body["data"]] == [("model.pt", 9), ("plots/loss.csv", 16)]
    # ISO 8601 in UTC, as every other time the API returns (an epoch float once)
    assert all(datetime.fromisoformat(f["modified"]).utcoffset() == timedelta(0) for f in body["data"])


def test_an_artifact_downloads_byte_for_byte(client, job_with_files):
    r = client.get(f"/v1/jobs/{job_with_files}/artifacts/model.pt")
    assert r.status_code == 200 and r.content == b"\x00weights\xff"
    assert client.get(f"/v1/jobs/{job_with_files}/artifacts/plots/loss.csv").text.startswith("step,loss")


@pytest.mark.parametrize("name", ["%2E%2E%2F%2E%2E%2Fsecret.txt", "plots%2F..%2F..%2Fx", "escape"])
def test_names_that_leave_the_job_folder_are_refused(client, job_with_files, name):
    r = client.get(f"/v1/jobs/{job_with_files}/artifacts/{name}")
    assert r.status_code == 422 and r.json()["field"] == "name"
    assert "not yours" not in r.text


def test_missing_artifacts_and_jobs_are_404(client, job_with_files):
    r = client.get(f"/v1/jobs/{job_with_files}/artifacts/nope.bin")
    assert r.status_code == 404 and r.json()["field"] == "name"
    assert client.get("/v1/jobs/0123456789abcdef0123/artifacts").status_code == 404
    assert client.get("/v1/jobs/..%2F..%2Fetc/artifacts").status_code == 404


def test_a_job_without_artifacts_lists_none(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    assert client.get(f"/v1/jobs/{job['id']}/artifacts").json() == {"items": [], "data": [], "count": 0}


@pytest.mark.parametrize("linked", ["artifacts", "job"])
def test_a_job_folder_swapped_for_a_link_serves_nothing_outside_it(client, settings, tmp_path, linked):
    """A running script can replace its artifacts folder (or its job folder) with a link to / or the data dir."""
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "artifacts").mkdir(parents=True)
    for folder in (elsewhere, elsewhere / "artifacts"):
        (folder / "admin.token").write_text("tj_not-yours")
    folder = storage.artifacts_dir(settings, job["id"])
    if linked == "job":
        folder = folder.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.symlink_to(elsewhere if linked == "job" else elsewhere / "artifacts")

    assert client.get(f"/v1/jobs/{job['id']}/artifacts").json() == {"items": [], "data": [], "count": 0}
    r = client.get(f"/v1/jobs/{job['id']}/artifacts/admin.token")
    assert r.status_code == 404 and "tj_not-yours" not in r.text


def test_links_and_special_files_inside_the_folder_are_neither_listed_nor_served(client, job_with_files, settings,
                                                                                  tmp_path):
    root = storage.artifacts_dir(settings, job_with_files)
    (root / "up").symlink_to(tmp_path)  # a link to a folder outside
    (root / "same").symlink_to(root / "model.pt")  # even one that stays inside: links are not followed
    os.mkfifo(root / "pipe")  # opening a FIFO would block the request forever
    names = [f["name"] for f in client.get(f"/v1/jobs/{job_with_files}/artifacts").json()["data"]]
    assert names == ["model.pt", "plots/loss.csv"]
    for name in ("up/secret.txt", "same"):
        r = client.get(f"/v1/jobs/{job_with_files}/artifacts/{name}")
        assert r.status_code == 422 and r.json()["field"] == "name" and "not yours" not in r.text
    assert client.get(f"/v1/jobs/{job_with_files}/artifacts/pipe").status_code == 404
