"""A stack whose workers join its API (issue 42): they hold no database URL and open no database connection,
yet run a DDP job and a two-node gang to the end, with their logs and metrics, as a database worker did."""

import psutil
import pytest
from sqlalchemy import create_engine, text

from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("joined"), name="joined", workers=2, join=True) as s:
        yield s


def worker_processes(stack) -> list[psutil.Process]:
    found = []
    for name, proc in stack.procs:
        if name.startswith("worker"):
            top = psutil.Process(proc.pid)
            found += [top, *top.children(recursive=True)]
    return found


def test_a_joined_worker_holds_no_database_url_and_opens_no_database_connection(stack, api, postgres_url):
    wait_for(lambda: len(api.get("/v1/workers").json()["items"]) >= 2, 120, what="both workers to register")
    job_id = api.post("/v1/jobs", json=mlp_spec()).json()["id"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] in ("running", "succeeded"), 180,
             what="the job to start")
    for proc in worker_processes(stack):
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        assert not env.get("TRAINJOBS_DATABASE_URL"), (proc.pid, proc.cmdline())
        assert "TRAINJOBS_WORKER_JOIN_TOKEN" not in env  # a file of the secrets dir holds it, not /proc
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        clients = conn.execute(text("SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
                                    " AND backend_type = 'client backend'")).scalars().all()
    engine.dispose()
    workers = {w["id"] for w in api.get("/v1/workers").json()["items"]}
    assert not workers & set(clients), clients  # a database worker's connections carry its name
    runners = api.get("/v1/runners").json()
    assert runners and all(r["revoked_at"] is None for r in runners)
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 240, what="the job to succeed")


def test_a_ddp_job_and_a_two_node_gang_run_to_the_end_with_their_logs_and_metrics(stack, api):
    ddp = api.post("/v1/jobs", json=mlp_spec(name="ddp")).json()["id"]
    gang = api.post("/v1/jobs", json=mlp_spec(name="gang", resources={"nnodes": 2, "nproc_per_node": 1,
                                                                       "device": "cpu"})).json()["id"]
    for job_id in (ddp, gang):
        job = wait_for(lambda job_id=job_id: (j := api.get(f"/v1/jobs/{job_id}").json())["status"]
                       in ("succeeded", "failed") and j, 400, what=f"job {job_id} to end")
        assert job["status"] == "succeeded", job
        [loss] = api.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"]
        assert loss["steps"] == list(range(5, 21, 5))  # each step once
        log = api.get(f"/v1/jobs/{job_id}/logs").text
        assert "step 20/20" in log and "[trainjobs] done" in log
    # Their ships, leases and the heartbeats went as ticks (worker/tick.py), not a call each.
    served = api.get("/metrics").text
    ticks = sum(float(line.rsplit(" ", 1)[1]) for line in served.splitlines() if line.startswith(
        "trainjobs_http_request_duration_seconds_count") and 'route="/v1/worker/tick"' in line)
    singles = [line for line in served.splitlines() if line.startswith("trainjobs_http_request_duration_seconds_count")
               and any(f'route="/v1/worker/{call}"' in line for call in ("ship", "leases", "heartbeat"))]
    assert ticks > 0 and singles == [], (ticks, singles)


def test_two_api_processes_one_killed_mid_run_lose_and_double_nothing(postgres_url, tmp_path):
    """Two API processes behind one port (uvicorn --workers 2, as the compose file runs them); one is SIGKILLed
    while a joined worker's job ships: the calls it was answering are sent again to the other, each applied once,
    and the job ends with every line and step exactly once."""
    from tests.test_worker_ship import NUMBERED, assert_each_line_and_step_once, start_numbered

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "numbered.py").write_text(NUMBERED)
    with live_stack(postgres_url, tmp_path / "stack", name="twoapi", workers=1, join=True, api_workers=2,
                    lease_s=90, allow_entrypoints=True, scripts_dir=scripts) as stack:
        with stack.client(timeout=10) as api:
            job_id = start_numbered(api)
            [top] = [psutil.Process(p.pid) for name, p in stack.procs if name == "api"]
            serving = [c for c in top.children() if "spawn_main" in " ".join(c.cmdline())]
            assert len(serving) == 2, [c.cmdline() for c in top.children()]
            serving[0].kill()
        with stack.client(timeout=10) as api:  # a new connection: the test's own one was to the killed process
            assert_each_line_and_step_once(api, job_id)
