"""Nothing a job writes can hurt its worker or lose its record (issue 37's fault suite): each case is a real job
through a real worker on PostgreSQL, asserting what its user sees and that the worker stayed healthy.

Metric floods (points, names, long names) end as the script ended, with a note of what the caps kept out; output
floods keep the log's head and tail (the traceback); a database stalled during a flood costs neither the lease nor
the worker's memory."""

import os
import re
import signal
import time

import psutil
from sqlalchemy import create_engine, text

from tests.helpers import module_stack, wait_for, wait_terminal

stack = module_stack("writes", allow_entrypoints=True, metric_max_points=20_000, log_max_bytes=2**20)

FLOOD_METRICS = """\
from trainjobs import report
for i in range(300_000):
    report(step=i, loss=1.0 / (i + 1))
print("reported", flush=True)
"""
MANY_NAMES = """\
from trainjobs import report
report(step=1, **{f"m{i}": float(i) for i in range(8000)})
report(step=2, loss=0.5, **{"x" * 80: 1.0})
"""
FLOOD_THEN_RAISE = """\
import sys
line = "y" * 1023 + "\\n"
for _ in range(30_000):
    sys.stdout.write(line)
raise ValueError("boom at the very end")
"""
HUGE_LINE = """\
import sys
sys.stdout.write("z" * 20_000_000)
sys.stdout.write("\\nthe end\\n")
"""
PRINT_FOR = """\
import os, sys, time
end = time.time() + float(os.environ["PRINT_S"])
block = ("w" * 200 + "\\n") * 100
while time.time() < end:
    sys.stdout.write(block)
print("done printing", flush=True)
"""


def submit_script(api, stack, name: str, code: str, **spec) -> str:
    scripts = stack.settings.data_dir / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / f"{name}.py").write_text(code)
    body = {"name": name, "resources": {"nproc_per_node": 1}, "entrypoint": {"script": f"{name}.py"}, **spec}
    answer = api.post("/v1/jobs", json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def attempts_of(api, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]


def note_of(job: dict) -> str:
    [warning] = [w for w in job["warnings"] if w["kind"] == "metrics_capped"]
    return warning["message"]


def test_a_metric_flood_ends_as_its_script_did_on_one_attempt_with_a_note_of_what_was_kept(api, stack):
    """300,000 report() calls in a tight loop once made a healthy worker 'lost' (its lease was renewed with the
    batch): now the lease is apart, the batch bounded, and past the per-job cap points are counted, not stored."""
    job_id = submit_script(api, stack, "flood_metrics", FLOOD_METRICS, max_retries=2)
    job = wait_terminal(api, job_id, timeout=180)
    assert job["status"] == "succeeded", job["error"]
    assert len(attempts_of(api, job_id)) == 1
    note = note_of(job)
    kept = int(re.match(r"kept ([\d,]+) of 300,000 metric points", note)[1].replace(",", ""))
    assert kept <= 20_000 and "past the job's cap (TRAINJOBS_METRIC_MAX_POINTS=20000)" in note, note
    [series] = api.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"]
    assert len(series["steps"]) == kept
    assert api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 299_999  # progress saw every step
    assert "[trainjobs] kept" in api.get(f"/v1/jobs/{job_id}/logs").text  # the log says it too


def test_eight_thousand_names_and_a_long_one_are_capped_with_a_note_and_the_job_succeeds(api, stack):
    """8,000 names at one step once failed every ship on PostgreSQL (an IN list too deep) and lost the whole job."""
    job_id = submit_script(api, stack, "many_names", MANY_NAMES)
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    note = note_of(job)
    assert note.startswith("kept 1,000 of 8,002 metric points; 7,001 under names past the job's 1000 "
                           "(TRAINJOBS_METRIC_MAX_NAMES; the first refused: 'm1000'); 1 under names longer than 64 "
                           "characters (the first: 'xxxx"), note
    names = {s["name"] for s in api.get(f"/v1/jobs/{job_id}/metrics").json()["series"]}
    assert len(names) == 1000 and "m999" in names
    assert "metric names are at most 64 characters" in api.get(f"/v1/jobs/{job_id}/logs").text  # report() warned


def test_an_output_flood_that_ends_in_an_exception_keeps_the_traceback_in_the_log(api, stack):
    job_id = submit_script(api, stack, "flood_then_raise", FLOOD_THEN_RAISE)
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "failed"
    log = api.get(f"/v1/jobs/{job_id}/logs").content
    assert len(log) <= 2**20 + 4096
    assert re.search(rb"\[trainjobs\] \.\.\. \d+ bytes of output cut here", log)
    assert b"ValueError: boom at the very end" in log[-8192:]


def test_one_huge_line_is_cut_to_the_cap_and_the_job_succeeds(api, stack):
    job_id = submit_script(api, stack, "huge_line", HUGE_LINE)
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    log = api.get(f"/v1/jobs/{job_id}/logs").content
    assert len(log) <= 2**20 + 4096 and log.rstrip().endswith(b"the end")


def worker_pss(stack) -> int:
    """The worker's own processes (the worker and its work-horse; not the job's ranks): PSS, shared pages split."""
    total = 0
    for name, proc in stack.procs:
        if not name.startswith("worker"):
            continue
        me = psutil.Process(proc.pid)
        for p in [me, *me.children()]:
            try:
                if p.name() in ("bwrap", "setpriv") or "torch.distributed.run" in " ".join(p.cmdline()):
                    continue
                total += p.memory_full_info().pss
            except psutil.NoSuchProcess:
                pass
    return total


def test_a_database_stalled_during_an_output_flood_costs_neither_the_lease_nor_the_workers_memory(
        api, stack, postgres_url):
    """Every backend of the stack's database stopped for 8 s while a job prints as fast as it can: the output is
    bounded in the worker (dropped with a count), the lease outlives the stall, and the job ends as it did."""
    job_id = submit_script(api, stack, "print_for", PRINT_FOR, env={"PRINT_S": "14"})
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 60, what="running")
    time.sleep(2)
    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        backends = conn.scalars(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND pid <> pg_backend_pid()")).all()
    engine.dispose()
    peak = 0
    for pid in backends:
        os.kill(pid, signal.SIGSTOP)
    try:
        stalled_until = time.monotonic() + 8
        while time.monotonic() < stalled_until:
            peak = max(peak, worker_pss(stack))
            time.sleep(0.5)
    finally:
        for pid in backends:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    job = wait_terminal(api, job_id, timeout=120)
    assert job["status"] == "succeeded", job["error"]
    assert len(attempts_of(api, job_id)) == 1
    assert peak < 150 * 2**20, f"the worker's processes reached {peak / 2**20:.0f} MiB"
    log = api.get(f"/v1/jobs/{job_id}/logs").content
    assert log.rstrip().endswith(b"done printing")
