"""The dashboard in a real browser: headless Debian Chromium, driven by Playwright, against a live stack.

Chromium is the system one (`apt-get install chromium`; .ci/run installs it), never `playwright install`.
Screenshots land in test-artifacts/ at the repository root.
"""

import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs import records
from service.jobs.models import Job
from service.metrics import service as metrics
from tests.conftest import mlp_spec
from tests.helpers import live_stack, wait_for, wait_terminal

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# A user's error message that looks like markup: the page must show it as text, never run it.
HOSTILE = '<img src=x onerror="window.__pwned = 1"><b>bad batch</b>'


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("dash"), name="dash", workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def api(stack):
    with stack.client(timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def jobs(api) -> dict[str, str]:
    """One finished job (failed, with a markup-like message) and one that keeps running until cancelled."""
    one = {"nnodes": 1, "nproc_per_node": 1, "device": "cpu"}
    failed = mlp_spec(name="dash-failed", resources=one, train={"max_steps": 40, "log_every": 2},
                      fault_injection={"raise_at_step": 12, "rank": 0, "message": HOSTILE})
    running = mlp_spec(name="dash-running", train={"max_steps": 10_000_000, "log_every": 20})
    ids = {"failed": api.post("/v1/jobs", json=failed).json()["id"],
           "running": api.post("/v1/jobs", json=running).json()["id"]}
    yield ids
    api.post(f"/v1/jobs/{ids['running']}/cancel")  # whatever a failing test left running


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (never `playwright install`)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, stack, request) -> Page:
    """A fresh page on the dashboard that has been given the admin token (when auth is on)."""
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{stack.api_url}/")
    expect(page.locator("#token-form")).to_be_visible()  # no token stored yet
    if stack.token:
        expect(page.locator("#token-form.needed")).to_be_visible()  # the API answered 401
        page.fill("#token-input", stack.token)
        page.click("#token-form button[type=submit]")
        expect(page.locator("#token-set")).to_be_visible()
    yield page
    page.screenshot(path=ARTIFACTS / f"{request.node.name}.png", full_page=True)  # where it ended, pass or fail
    context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def rows(page: Page):
    return page.locator("#jobs-table tbody tr")


def test_jobs_table_lists_jobs_newest_first_filters_by_status_and_shows_user_text_as_text(page, api, jobs,
                                                                                           postgres_url):
    wait_terminal(api, jobs["failed"], timeout=60)
    engine = create_engine(postgres_url)  # a warning, as the supervisor writes one (a straggler named)
    with engine.begin() as db:
        db.execute(update(Job).where(Job.id == jobs["failed"]).values(warnings=[
            {"kind": "straggler", "rank": 1, "attempt": 1, "message": f"rank 1 is slow {HOSTILE}"}]))
    engine.dispose()
    expect(rows(page)).to_have_count(2)
    expect(rows(page).nth(0)).to_contain_text("dash-running")  # newest first
    expect(rows(page).nth(1)).to_contain_text("dash-failed")
    expect(rows(page).nth(1)).to_contain_text("failed")
    expect(rows(page).nth(0).locator("td").nth(4)).to_have_text("1×2")  # nnodes × nproc_per_node

    page.click("#status-filter button[data-status=failed]")
    expect(rows(page)).to_have_count(1)
    expect(rows(page).nth(0)).to_contain_text("dash-failed")
    page.click("#status-filter button[data-status=succeeded]")
    expect(page.locator("#jobs-empty")).to_be_visible()
    page.click("#status-filter button[data-status='']")
    expect(rows(page)).to_have_count(2)

    page.click("text=dash-failed")
    expect(page.locator("#job-status")).to_have_text("failed")
    expect(page.locator("#job-error")).to_contain_text(HOSTILE)  # shown literally...
    expect(page.locator("#job-warnings")).to_have_text(f"straggler: rank 1 is slow {HOSTILE}")
    expect(page.locator("#job-stacks-box")).to_be_hidden()  # no dump was taken
    expect(page.locator("#log")).to_contain_text("bad batch")
    assert page.locator("main img, main b").count() == 0  # ...never parsed as markup
    assert page.evaluate("window.__pwned") is None
    expect(page.locator("#job-cancel")).to_be_hidden()  # a finished job has nothing to cancel
    # A page that has not yet seen the job end still offers the button: the API's refusal is shown.
    page.evaluate("document.getElementById('job-cancel').hidden = false")
    page.click("#job-cancel")
    expect(page.locator("#job-cancel-error")).to_contain_text("already failed")
    expect(page.locator("#attempts-table tbody tr")).to_have_count(1)
    expect(page.locator("#attempts-table tbody")).to_contain_text("failed")


def test_job_page_follows_a_running_job_live_and_cancels_it(page, api, jobs):
    job_id = jobs["running"]
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "running", 90, what="the job to run")
    # The workers page shows what GET /v1/workers says about the one worker.
    page.click("header nav a[data-nav=workers]")
    (shown,) = api.get("/v1/workers").json()["items"]
    worker = page.locator("#workers-table tbody tr td")
    expect(worker.nth(0)).to_have_text(shown["state"])
    expect(worker.nth(1)).to_have_text(shown["id"])
    expect(worker.nth(3)).to_have_text("cpu")
    expect(worker.nth(6)).to_have_text(f"{shown['busy_slots']}/{shown['slots']}")
    expect(worker.nth(7)).to_have_text(shown["current_job"] or "idle")
    expect(worker.nth(8)).to_contain_text("ago")
    page.screenshot(path=ARTIFACTS / "dashboard-workers.png")

    page.click("header nav a[data-nav=jobs]")
    page.click("text=dash-running")
    expect(page).to_have_url(re.compile(f"#/jobs/{job_id}$"))
    expect(page.locator("#job-status")).to_have_text("running")
    # The loss curve is drawn and grows as the stream brings new points.
    loss = page.locator("#chart-loss path.line.s0")
    expect(loss).to_have_attribute("d", re.compile(r"^M[\d.]+,[\d.]+(L[\d.]+,[\d.]+){2,}$"), timeout=30_000)
    drawn = loss.get_attribute("d").count("L")
    wait_for(lambda: loss.get_attribute("d").count("L") > drawn, 30, what="the stream to add loss points")
    expect(page.locator("#chart-throughput path.line")).to_have_count(1)
    expect(page.locator("#throughput-caption")).to_have_text("samples/s")
    expect(page.locator("#log")).to_contain_text(re.compile(r"step \d+/10000000"))
    expect(page.locator("#log-state")).to_have_text("(following)")
    expect(page.locator("#plan-table")).to_contain_text("per device")
    expect(page.locator("#job-spec")).to_contain_text('"dash-running"')

    asked = api.post(f"/v1/jobs/{job_id}/stacks", timeout=30)  # every rank's stack, the job left running
    assert asked.status_code == 200, asked.text
    page.click("#job-cancel")
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=30_000)
    expect(page.locator("#job-stacks-meta")).to_contain_text("requested")
    expect(page.locator("#job-stacks summary")).to_have_count(2)
    expect(page.locator("#job-stacks summary").nth(0)).to_contain_text("rank 0 (pid")
    expect(page.locator("#job-cancel")).to_be_hidden()
    expect(page.locator("#log-state")).to_have_text("(ended)", timeout=10_000)
    expect(page.locator("#attempts-table tbody")).to_contain_text("cancelled")
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    page.screenshot(path=ARTIFACTS / "dashboard-job.png", full_page=True)

    page.click("header nav a[data-nav=jobs]")
    expect(rows(page).nth(0)).to_contain_text("cancelled")
    # Nothing changes any more, so the next poll sends If-None-Match and the API answers 304.
    with page.expect_response(lambda r: "/v1/jobs?" in r.url and r.status == 304, timeout=10_000) as polled:
        pass
    assert polled.value.request.headers.get("if-none-match")
    page.screenshot(path=ARTIFACTS / "dashboard-jobs.png", full_page=True)


def test_a_gang_s_memory_chart_draws_a_line_per_node(page, api, postgres_url):
    resources = {"nnodes": 2, "nproc_per_node": 1, "device": "cpu", "selector": {"pool": "nowhere"}}
    job_id = api.post("/v1/jobs", json=mlp_spec(name="dash-gang", resources=resources)).json()["id"]  # stays queued
    engine = create_engine(postgres_url)
    with Session(engine) as db:  # what each node's supervisor ships: its local rank 0's series
        for node, memory in ((0, 100.0), (1, 180.0)):
            rows = [(s, name, value, utcnow()) for s in range(1, 11)
                    for name, value in (("loss", 1 / s), ("peak_mem_mb", memory + s))]
            metrics.insert_batch(db, job_id=job_id, attempt=1, node_rank=node, rows=rows)
        db.commit()
    engine.dispose()
    page.evaluate(f"location.hash = '#/jobs/{job_id}'")
    expect(page.locator("#job-name")).to_have_text("dash-gang")
    expect(page.locator("#chart-memory path.line")).to_have_count(2, timeout=15_000)
    expect(page.locator("#chart-memory text.legend")).to_have_text(["node 0", "node 1"])
    expect(page.locator("#chart-loss path.line")).to_have_count(1)  # the job's loss: node 0's series only
    api.post(f"/v1/jobs/{job_id}/cancel")


def test_a_job_page_charts_each_ranks_step_time_and_cpu_and_shows_an_idle_warning(page, api, postgres_url):
    resources = {"nnodes": 1, "nproc_per_node": 2, "device": "cpu", "selector": {"pool": "nowhere"}}
    job_id = api.post("/v1/jobs", json=mlp_spec(name="dash-ranks", resources=resources)).json()["id"]  # queued
    engine = create_engine(postgres_url)
    with Session(engine) as db:  # what the runtime reports (step_time_s/rank<r>) and the supervisor samples
        rows = [(s, f"{name}{rank}", value * (rank + 1) + s / 100, utcnow()) for s in range(1, 11) for rank in (0, 1)
                for name, value in (("step_time_s/rank", 0.01), ("cpu_util/rank", 40.0))]
        metrics.insert_batch(db, job_id=job_id, attempt=1, rows=rows)
        records.add_warning(db, job_id=job_id, warning={"kind": "idle", "rank": None, "attempt": 1,
                                                        "message": "every rank's CPU use stayed low"})
        db.commit()
    engine.dispose()
    page.evaluate(f"location.hash = '#/jobs/{job_id}'")
    expect(page.locator("#job-name")).to_have_text("dash-ranks")
    expect(page.locator("#chart-ranks path.line")).to_have_count(2, timeout=15_000)
    expect(page.locator("#chart-ranks text.legend")).to_have_text(["rank 0", "rank 1"])
    expect(page.locator("#chart-usage path.line")).to_have_count(2)
    expect(page.locator("#usage-caption")).to_have_text("CPU use per rank (% of a core)")
    expect(page.locator("#job-warnings li")).to_have_text(["idle: every rank's CPU use stayed low"])
    api.post(f"/v1/jobs/{job_id}/cancel")
