"""`trainjobs list`: fits 80 columns (ids and statuses whole, names shortened), shows how long each job has run
and how old it is, says when more jobs exist, and takes --all, --limit, --status, --name, --mine."""

import json
from datetime import UTC, datetime, timedelta

import pytest

from service.cli import tables
from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs import lifecycle
from tests.conftest import mlp_spec
from tests.test_cli_ids import no_user_config, run  # noqa: F401 - the fixture, used by every test here
from trainjobs.client import Client
from trainjobs.states import JobStatus

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def job(name: str, status: str = "queued", *, reason: str | None = None, created_s: float = 30,
        started_s: float | None = None, finished_s: float | None = None, pending: str | None = None) -> dict:
    """A job as the API lists it, times in seconds before NOW."""
    def at(s):
        return None if s is None else (NOW - timedelta(seconds=s)).isoformat()

    return {"id": "0193a1b2c3d4e5f6a7b8", "name": name, "owner": "alice", "status": status, "reason": reason,
            "spec": {"strategy": "ddp", "resources": {"nnodes": 1, "nproc_per_node": 2}},
            "progress": {"step": 150, "total_steps": 300}, "created_at": at(created_s), "started_at": at(started_s),
            "finished_at": at(finished_s), "pending_reason": pending}


def test_the_list_fits_80_columns_with_every_id_and_status_whole():
    jobs = [job("a-very-long-experiment-name-that-goes-on-lr-3e-4-trial-007", "running", started_s=75),
            job("short", "cancelled", reason="stopped_early", created_s=7200, started_s=7000, finished_s=3600),
            job("waits", pending="no live worker fits (2 processes: device cpu, needs cuda)")]
    lines = tables.jobs_lines(jobs, width=80, now=NOW)
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].split() == ["ID", "NAME", "STATUS", "STEP", "ELAPSED", "AGE"]
    running, cancelled, queued = lines[1:]
    assert running.startswith("0193a1b2c3d4e5f6a7b8  a-very-long-ex…") and "…" in running
    assert running.split()[1].endswith("-007")  # its end kept: trials and runs stay apart
    assert running.split()[2:] == ["running", "150/300", "1m15s", "30s"]
    # the long name needs the room: the reason gives way (`status ID` and a wide list show it)
    assert cancelled.split()[1:] == ["short", "cancelled", "150/300", "56m40s", "2h00m"]
    assert queued.split()[2:] == ["queued", "150/300", "30s"]  # never started: no elapsed time


def test_a_wide_terminal_shows_owner_world_and_why_a_job_waits():
    jobs = [job("a-very-long-experiment-name-that-goes-on-lr-3e-4-trial-007"),
            job("waits", pending="no live worker fits (2 processes: device cpu, needs cuda)")]
    lines = tables.jobs_lines(jobs, width=200, now=NOW)
    assert lines[0].split() == ["ID", "NAME", "OWNER", "STATUS", "STRATEGY", "WORLD", "STEP", "ELAPSED", "AGE",
                                "WAITING"]
    assert "a-very-long-experiment-name-that-goes-on-lr-3e-4-trial-007" in lines[1]
    assert lines[2].split()[1:8] == ["waits", "alice", "queued", "ddp", "1×2", "150/300", "30s"]
    assert lines[2].endswith("30s  no live worker fits (2 processes: device cpu, needs cuda)")


def test_a_reason_is_shown_where_it_fits_and_gives_way_before_a_name_does():
    jobs = [job("trial-3", "cancelled", reason="stopped_early")]
    header, line = tables.jobs_lines(jobs, width=80, now=NOW)
    assert line.split()[1:4] == ["trial-3", "cancelled", "(stopped_early)"]
    jobs = [job("name-of-twenty-chars", "cancelled", reason="stopped_early_by_the_controller")]
    header, line = tables.jobs_lines(jobs, width=80, now=NOW)
    assert len(line) <= 80 and line.split()[1:3] == ["name-of-twenty-chars", "cancelled"]


@pytest.mark.parametrize(("seconds", "shown"), [(0, "0s"), (59, "59s"), (61, "1m01s"), (3600 * 5 + 120, "5h02m"),
                                                 (86400 * 2 + 3600 * 3, "2d03h")])
def test_durations_are_short(seconds, shown):
    assert tables.format_duration(seconds) == shown


def test_list_says_when_more_exist_and_all_reads_every_page(client, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    ids = [client.post("/v1/jobs", json=mlp_spec(name=f"n{i}")).json()["id"] for i in range(5)]
    out, err = run(client, capsys, "list", "--limit", "2")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ids[::-1][:2]
    assert "the newest 2 shown; more exist: --limit N, or --all" in err
    out, err = run(client, capsys, "list")
    assert len(out.splitlines()) == 6 and err == ""  # the header and the 5: no more
    assert all(len(line) <= 80 for line in out.splitlines())
    monkeypatch.setattr("service.cli.jobs.PAGE", 2)  # --all: page after page
    out, err = run(client, capsys, "list", "--all")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ids[::-1] and err == ""
    page = json.loads(run(client, capsys, "list", "--limit", "3", "--json")[0])
    assert [j["id"] for j in page["items"]] == ids[::-1][:3] and page["next_cursor"] == ids[2]


def test_list_filters_by_status_name_and_owner(client, capsys):
    queued = client.post("/v1/jobs", json=mlp_spec(name="keep-a")).json()["id"]
    cancelled = client.post("/v1/jobs", json=mlp_spec(name="keep-b")).json()["id"]
    client.post("/v1/jobs", json=mlp_spec(name="other"))
    client.post(f"/v1/jobs/{cancelled}/cancel")
    out, _ = run(client, capsys, "list", "--status", "cancelled")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [cancelled]
    out, _ = run(client, capsys, "list", "--name", "keep", "--status", "queued")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [queued]
    out, _ = run(client, capsys, "list", "--mine", "--name", "keep")
    assert len(out.splitlines()) == 3
    out, _ = run(client, capsys, "list", "--status", "running")
    assert out == "no jobs match\n"


def test_list_shows_a_running_job_s_elapsed_time(client, settings, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    job_id = client.post("/v1/jobs", json=mlp_spec(name="runs")).json()["id"]
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        started = utcnow() - timedelta(seconds=125)
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.STARTING,
                                    values={"attempt": 1, "started_at": started})
        assert lifecycle.transition(db, job_id=job_id, to=JobStatus.RUNNING)
        db.commit()
    engine.dispose()
    out, _ = run(client, capsys, "list")
    row = out.splitlines()[1].split()
    assert row[:3] == [job_id, "runs", "running"] and row[4].startswith("2m0")


def test_the_sdk_pages_through_every_job(client):
    ids = [client.post("/v1/jobs", json=mlp_spec(name=f"p{i}")).json()["id"] for i in range(5)]
    api = Client("http://testserver")
    api.http = client
    assert [j["id"] for j in api.iter_jobs(page_size=2)] == ids[::-1]
