"""The dashboard in a real browser: headless Debian Chromium, driven by Playwright, against a live stack.

Chromium is the system one (`apt-get install chromium`; .ci/run installs it), never `playwright install`.
Screenshots land in test-artifacts/ at the repository root. With TRAINJOBS_SCREENSHOTS=<folder> (`make screenshots`:
docs/images) the tests that walk the jobs list, a job's page, the queue and the workers also save the pictures the
docs show, so the docs show what the code draws today.
"""

import os
import re
import shutil
from datetime import timedelta
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
from tests.test_auth import make_token

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
DOCS_SHOTS = os.environ.get("TRAINJOBS_SCREENSHOTS")
DOCS_VIEWPORT = {"width": 1200, "height": 750}  # small enough for a page of the docs, PNGs well under 200 KB
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


def shoot_for_docs(page: Page, name: str) -> None:
    """With TRAINJOBS_SCREENSHOTS set, save what the page shows now as <folder>/<name>.png at the docs' size."""
    if not DOCS_SHOTS:
        return
    folder = Path(DOCS_SHOTS)
    folder.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    page.set_viewport_size(DOCS_VIEWPORT)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=folder / f"{name}.png", animations="disabled")
    page.set_viewport_size(size)


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
    # The row's name says "failed" too: wait for its bar to be painted failed (the list re-reads on its own).
    expect(rows(page).nth(1).locator(".progress .fill")).to_have_class(re.compile(r"\bfailed\b"))
    listed_colour = rows(page).nth(1).locator(".progress .fill").evaluate("e => getComputedStyle(e).backgroundColor")
    expect(rows(page).nth(0).locator("td").nth(5)).to_have_text("1×2")  # nnodes × nproc_per_node

    page.click("#status-filter button[data-status=failed]")
    expect(rows(page)).to_have_count(1)
    expect(rows(page).nth(0)).to_contain_text("dash-failed")
    page.click("#status-filter button[data-status=succeeded]")
    expect(page.locator("#jobs-empty")).to_be_visible()
    page.click("#status-filter button[data-status='']")
    expect(rows(page)).to_have_count(2)

    page.click("text=dash-failed")
    expect(page.locator("#job-status")).to_have_text("failed")
    # The job page paints the failed job's bar as the list does (issue 36: it was blue there, red in the list).
    assert page.locator("#job-bar").evaluate("e => getComputedStyle(e).backgroundColor") == listed_colour
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
    expect(rows(page).filter(has_text="dash-running")).to_contain_text("running")
    shoot_for_docs(page, "dashboard-jobs")
    # The workers page shows what GET /v1/workers says about the one worker.
    page.click("header nav a[data-nav=workers]")
    (shown,) = api.get("/v1/workers").json()["items"]
    worker = page.locator("#workers-table tbody tr td")
    expect(worker.nth(0)).to_have_text(shown["state"])
    expect(worker.nth(1)).to_have_text(shown["id"])
    expect(worker.nth(3)).to_have_text("cpu")
    expect(worker.nth(6)).to_have_text(f"{shown['busy_slots']}/{shown['slots']}")
    # One square a device, held by the running job or free (a shared worker's occupancy at a glance).
    expect(worker.nth(7).locator("span.dev")).to_have_count(len(shown["devices"]))
    expect(worker.nth(7).locator("span.dev.held")).to_have_count(sum(d["state"] == "held" for d in shown["devices"]))
    expect(worker.nth(8)).to_have_text(" ".join(shown["jobs"]) or shown["current_job"] or "idle")
    expect(worker.nth(9)).to_contain_text("ago")
    page.screenshot(path=ARTIFACTS / "dashboard-workers.png")
    shoot_for_docs(page, "dashboard-workers")

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
    shoot_for_docs(page, "dashboard-job")

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
    job_id = api.post("/v1/jobs", json=mlp_spec(name="dash-gang", resources=resources),
                      params={"allow_unschedulable": "true"}).json()["id"]  # stays queued
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


# Three of alice's runs that differ only in optimizer.lr, as their workers would have left them, and one of bob's.
COMPARED = {"cmp-a": 0.01, "cmp-b": 0.003, "cmp-c": 0.001}


@pytest.fixture(scope="module")
def compared(stack, api, postgres_url) -> dict[str, str]:
    """name → id of alice's three finished runs (curves, summaries) and bob's one ("cmp-bob"); alice's token."""
    headers = {user: {"Authorization": f"Bearer {make_token(stack.settings, user)}"} for user in ("alice", "bob")}
    nowhere = {"nnodes": 1, "nproc_per_node": 1, "device": "cpu", "selector": {"pool": "nowhere"}}  # stays queued
    ids = {}
    for name, lr in COMPARED.items():
        spec = mlp_spec(name=name, tags=["study=cmp"], resources=nowhere, optimizer={"type": "adamw", "lr": lr})
        ids[name] = api.post("/v1/jobs", json=spec, headers=headers["alice"],
                             params={"allow_unschedulable": "true"}).json()["id"]
    spec = mlp_spec(name="cmp-bob", tags=["study=other"], resources=nowhere)
    ids["cmp-bob"] = api.post("/v1/jobs", json=spec, headers=headers["bob"],
                              params={"allow_unschedulable": "true"}).json()["id"]
    engine = create_engine(postgres_url)
    now = utcnow()
    with Session(engine) as db:  # what each run's supervisor would have shipped and recorded
        for k, name in enumerate(COMPARED):
            points = [(s, "loss", (k + 1) / s, now) for s in range(1, 21)]
            points += [(s, "samples_per_s", 100.0 * (k + 1), now) for s in range(1, 21)]
            if name == "cmp-b":
                points += [(s, "eval_loss", 2 / s, now) for s in (10, 20)]
            metrics.insert_batch(db, job_id=ids[name], attempt=1, node_rank=0, rows=points)
            db.execute(update(Job).where(Job.id == ids[name]).values(
                status="succeeded", started_at=now - timedelta(seconds=90 + k), finished_at=now,
                progress={"step": 20, "eta_s": 0},
                summary={"final_loss": (k + 1) / 20, "steps": 20, "samples_per_s": 100.0 * (k + 1)}))
        db.commit()
    engine.dispose()
    ids["alice_token"] = headers["alice"]["Authorization"].removeprefix("Bearer ")
    return ids


def test_jobs_list_filters_by_name_prefix_and_tag_kept_in_the_url_and_compares_the_picked_jobs(page, compared):
    expect(rows(page).first).to_be_visible()
    page.fill("#filter-name", "cmp-")
    expect(rows(page)).to_have_count(4)  # the admin sees bob's too
    expect(page).to_have_url(re.compile(r"#/\?name=cmp-$"))
    page.fill("#filter-tag", "study=cmp")
    expect(rows(page)).to_have_count(3)
    expect(rows(page).locator("td:nth-child(3) a")).to_have_text(["cmp-c", "cmp-b", "cmp-a"])  # newest first
    expect(page).to_have_url(re.compile(r"#/\?name=cmp-&tag=study%3Dcmp$"))
    page.reload()  # the filters are in the URL: a bookmark shows the same list
    expect(page.locator("#filter-name")).to_have_value("cmp-")
    expect(page.locator("#filter-tag")).to_have_value("study=cmp")
    expect(rows(page)).to_have_count(3)
    page.click("#jobs-table button.tag >> nth=0")  # a job's tag is a filter too; it is already this one
    expect(rows(page)).to_have_count(3)

    compare = page.locator("#compare-open")
    expect(compare).to_be_disabled()
    page.check("#jobs-table input[aria-label='select cmp-a']")
    expect(compare).to_be_disabled()  # one job is no comparison
    page.check("#jobs-table input[aria-label='select cmp-b']")
    expect(compare).to_be_enabled()
    page.check("#jobs-table input[aria-label='select cmp-c']")
    expect(compare).to_have_text("Compare 3")
    compare.click()
    ids = ",".join(compared[name] for name in ("cmp-a", "cmp-b", "cmp-c"))
    expect(page).to_have_url(re.compile(f"#/compare\\?ids={ids}$"))
    expect(page.locator("#compare-chart path.line")).to_have_count(3)
    expect(page.locator("#compare-legend li .name")).to_have_text(["cmp-a", "cmp-b", "cmp-c"])

    page.go_back()  # the selection outlives the visit
    expect(page.locator("#selected-count")).to_have_text("3 selected")
    page.click("#selected-clear")
    expect(compare).to_be_disabled()
    expect(page.locator("#jobs-table input:checked")).to_have_count(0)


def test_compare_view_overlays_curves_lists_only_differing_spec_fields_and_says_not_found_for_another_user_s_job(
        page, compared):
    page.click("#token-forget")  # alice, who cannot see bob's job
    page.fill("#token-input", compared["alice_token"])
    page.click("#token-form button[type=submit]")
    runs = [compared[name] for name in ("cmp-a", "cmp-b", "cmp-c", "cmp-bob")]
    page.evaluate(f"location.hash = '#/compare?ids={','.join(runs)}'")

    expect(page.locator("#compare-chart path.line")).to_have_count(3)  # one curve per found job, shared axes
    expect(page.locator("#compare-chart path.line.s0")).to_have_attribute(
        "d", re.compile(r"^M[\d.]+,[\d.]+(L[\d.]+,[\d.]+){19}$"))
    expect(page.locator("#compare-caption")).to_have_text("loss")
    legend = page.locator("#compare-legend li")
    expect(legend).to_have_count(4)
    expect(legend.locator(".name")).to_have_text(["cmp-a", "cmp-b", "cmp-c", compared["cmp-bob"]])
    expect(legend.nth(0)).to_contain_text(compared["cmp-a"])
    expect(legend.nth(3)).to_contain_text("not found")

    summary = page.locator("#compare-summary tbody tr")
    expect(summary.nth(0).locator("td")).to_have_text(["succeeded", "succeeded", "succeeded", "not found"])
    expect(summary.nth(1).locator("td")).to_have_text(["20/20", "20/20", "20/20", ""])  # steps of max_steps
    expect(summary.nth(2).locator("td")).to_have_text(["0.05000", "0.1000", "0.1500", ""])  # final loss
    expect(summary.nth(3).locator("td").nth(2)).to_have_text("300 samples/s")
    expect(summary.nth(4).locator("td").nth(0)).to_have_text("1m 30s")

    spec = page.locator("#compare-spec tbody tr")
    expect(spec.locator("th")).to_have_text(["optimizer.lr"])  # the only field that differs
    expect(spec.nth(0).locator("td")).to_have_text(["0.01", "0.003", "0.001"])
    expect(page.locator("#compare-same")).to_contain_text("identical fields hidden")
    page.click("#compare-show-same")
    expect(page.locator("#compare-spec tbody tr.same th", has_text=re.compile("^optimizer.type$"))).to_have_count(1)
    expect(page.locator("#compare-spec tbody tr.same th", has_text=re.compile("^name$"))).to_have_count(0)

    # Any metric of any of them: the choice is the union, and it goes into the URL.
    expect(page.locator("#compare-metric option")).to_have_text(["loss", "eval_loss", "samples_per_s"])
    page.select_option("#compare-metric", "eval_loss")
    expect(page.locator("#compare-chart path.line")).to_have_count(1)
    expect(page.locator("#compare-chart path.line.s1")).to_have_count(1)  # cmp-b keeps its colour
    expect(legend.nth(0)).to_contain_text("(no eval_loss)")
    expect(page).to_have_url(re.compile(r"&metric=eval_loss$"))
    page.reload()
    expect(page.locator("#compare-metric")).to_have_value("eval_loss")
    expect(page.locator("#compare-chart path.line")).to_have_count(1)
    page.screenshot(path=ARTIFACTS / "dashboard-compare.png", full_page=True)
    # A finished job's page says how fast it ran (GET /v1/jobs/{id}'s performance); no FLOPs count: no MFU.
    # The compare view read this job already: the job view's first read is a 304, and it renders all the same.
    page.evaluate(f"location.hash = '#/jobs/{compared['cmp-c']}'")
    expect(page.locator("#job-performance")).to_have_text(
        "Performance: 300 samples/s · MFU unknown (no FLOPs count or an unknown device)")


def test_compare_view_follows_a_job_that_has_not_ended(page, api, compared, postgres_url):
    nowhere = {"nnodes": 1, "nproc_per_node": 1, "device": "cpu", "selector": {"pool": "nowhere"}}
    live = api.post("/v1/jobs", json=mlp_spec(name="live-1", resources=nowhere),
                    params={"allow_unschedulable": "true"}).json()["id"]  # stays queued
    engine = create_engine(postgres_url)

    def ship(steps):  # as a running job's supervisor does, batch by batch
        with Session(engine) as db:
            metrics.insert_batch(db, job_id=live, attempt=1, node_rank=0,
                                 rows=[(s, "loss", 1 / s, utcnow()) for s in steps])
            db.commit()

    ship(range(1, 6))
    page.evaluate(f"location.hash = '#/compare?ids={live},{compared['cmp-a']}'")
    line = page.locator("#compare-chart path.line.s0")
    expect(line).to_have_attribute("d", re.compile(r"^M[\d.,]+(L[\d.]+,[\d.]+){4}$"))
    expect(page.locator("#compare-summary tbody tr").nth(0).locator("td")).to_have_text(["queued", "succeeded"])
    ship(range(6, 11))
    expect(line).to_have_attribute("d", re.compile(r"^M[\d.,]+(L[\d.]+,[\d.]+){9}$"), timeout=15_000)  # 5 s poll
    engine.dispose()
    api.post(f"/v1/jobs/{live}/cancel")


def test_the_queue_page_shows_waiting_jobs_in_start_order_with_their_reasons(page, api):
    nowhere = {"nproc_per_node": 1, "device": "cpu", "selector": {"zone": "nowhere"}}  # no worker fits: they wait
    ids = [api.post("/v1/jobs", json=mlp_spec(name=f"dash-wait-{i}", resources=nowhere),
                    params={"allow_unschedulable": "true"}).json()["id"]
           for i in range(2)]
    try:
        page.click("header nav a[data-nav=queue]")
        rows = page.locator("#queue-table tbody tr").filter(has_text="dash-wait-")  # other tests' jobs wait too
        expect(rows).to_have_count(2)
        expect(rows.nth(0).locator("td").nth(1)).to_have_text("dash-wait-0")
        expect(rows.nth(1).locator("td").nth(1)).to_have_text("dash-wait-1")
        expect(rows.nth(0).locator("td.reason")).to_contain_text("no live worker fits")
        positions = [int(rows.nth(i).locator("td").nth(0).inner_text()) for i in range(2)]
        assert positions[0] < positions[1]
        expect(page.locator("#queue-standing")).to_contain_text("policy fair")
        shoot_for_docs(page, "dashboard-queue")
        page.click("header nav a[data-nav=jobs]")  # the jobs list says it on the status (a tooltip)
        expect(page.locator(f"#jobs-table tr[data-job='{ids[0]}'] td").nth(1)).to_have_attribute(
            "title", re.compile("^waiting: no live worker fits"))
        page.goto(f"{page.url.split('#')[0]}#/jobs/{ids[0]}")  # the job's own page says why it waits, too
        expect(page.locator("#job-pending")).to_contain_text("waiting: no live worker fits")
    finally:
        for job_id in ids:
            api.post(f"/v1/jobs/{job_id}/cancel")


def test_a_job_page_charts_each_ranks_step_time_and_cpu_and_shows_an_idle_warning(page, api, postgres_url):
    resources = {"nnodes": 1, "nproc_per_node": 2, "device": "cpu", "selector": {"pool": "nowhere"}}
    job_id = api.post("/v1/jobs", json=mlp_spec(name="dash-ranks", resources=resources),
                      params={"allow_unschedulable": "true"}).json()["id"]  # queued
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


def test_without_a_token_the_banner_names_the_admin_token_file_and_trainjobs_login(browser, stack):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(f"{stack.api_url}/")
        expect(page.locator("#token-form.needed")).to_be_visible()
        expect(page.locator("#banner")).to_contain_text("trainjobs-data-secrets/admin.token")
        expect(page.locator("#banner")).to_contain_text("trainjobs login")
    finally:
        context.close()


def test_a_job_that_reports_no_steps_shows_no_step_bar_and_says_how_to_report(page, api, postgres_url):
    """A script of one's own that never calls trainjobs.report(): no full green "step 0" bar, no "no data yet"
    for ever, but a line saying how to report steps."""
    from service.jobs import lifecycle
    from trainjobs.states import JobStatus

    nowhere = {"nnodes": 1, "nproc_per_node": 1, "device": "cpu", "selector": {"pool": "nowhere"}}
    job_id = api.post("/v1/jobs", json=mlp_spec(name="dash-no-steps", resources=nowhere),
                      params={"allow_unschedulable": "true"}).json()["id"]  # no worker takes it: moved by hand
    engine = create_engine(postgres_url)
    with Session(engine) as db:
        for to, values in ((JobStatus.STARTING, {"attempt": 1, "started_at": utcnow()}),
                           (JobStatus.RUNNING, {"progress": {"step": 0, "total_steps": None}}),
                           (JobStatus.SUCCEEDED, {"finished_at": utcnow()})):
            assert lifecycle.transition(db, job_id=job_id, to=to, values=values)
            db.commit()
    engine.dispose()
    expect(page.locator(f"#jobs-table tr[data-job='{job_id}']")).to_contain_text("no steps reported")
    expect(page.locator(f"#jobs-table tr[data-job='{job_id}'] .progress")).to_have_count(0)
    page.evaluate(f"location.hash = '#/jobs/{job_id}'")
    expect(page.locator("#job-name")).to_have_text("dash-no-steps")
    expect(page.locator("#job-no-steps")).to_contain_text("This job reported no steps")
    expect(page.locator("#job-no-steps")).to_contain_text("trainjobs.report(step, loss=..., total_steps=N)")
    expect(page.locator("#job-progress-box")).to_be_hidden()
    expect(page.locator("#chart-loss text.empty")).to_have_text("none reported")
