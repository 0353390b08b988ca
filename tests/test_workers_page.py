"""The dashboard's workers page in a real browser (issue 42): a page of GET /v1/workers at a time, and its state,
labels and free-devices filters, against a live API on PostgreSQL (the workers are rows: no worker runs)."""

from datetime import timedelta

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.workers import holds
from service.workers import service as workers
from service.workers.models import Worker
from tests.helpers import live_stack
from tests.test_dashboard import browser, page  # noqa: F401 (fixtures: the system Chromium, a page with the token)

N = 60  # more than a page (50)


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("wpage"), name="wpage", workers=0, lease_s=600) as s:
        engine = create_engine(postgres_url)
        with Session(engine) as db:
            for i in range(N):
                devices = [{"index": d, "uuid": f"GPU-{i}-{d}", "memory_bytes": 2**34, "healthy": True,
                            "numa_node": 0, "cores": [d], "reason": None} for d in range(4)]
                workers.register(db, worker_id=f"gpu{i:02d}", host=f"gpu{i:02d}", address=f"10.0.0.{i}",
                                 device="cuda", slots=4, memory_bytes=2**34, host_memory_bytes=2**36,
                                 labels={"zone": "ab"[i % 2]}, max_jobs=4, devices=devices)
            db.commit()
            for i in range(0, N, 3):  # every third worker has 3 of its 4 devices taken
                assert holds.take(db, worker_id=f"gpu{i:02d}", job_id=f"job{i:017d}", node_rank=0, devices=[0, 1, 2])
            db.execute(update(Worker).where(Worker.id == "gpu07").values(last_seen=utcnow() - timedelta(hours=0.5)))
            db.commit()
        engine.dispose()
        yield s


def rows(on: Page):
    return on.locator("#workers-table tbody tr")


def test_the_workers_page_shows_a_page_at_a_time_and_filters_on_the_api(page: Page):  # noqa: F811
    page.click("header nav a[data-nav=workers]")
    expect(rows(page)).to_have_count(50)
    expect(rows(page).first.locator("td").nth(1)).to_have_text("gpu00")
    expect(page.locator("#workers-prev")).to_be_disabled()
    page.click("#workers-next")
    expect(rows(page)).to_have_count(N - 50)
    expect(rows(page).first.locator("td").nth(1)).to_have_text("gpu50")
    expect(page.locator("#workers-next")).to_be_disabled()
    expect(page.locator("#workers-page-no")).to_have_text("page 2")

    page.click("#worker-state-filter button[data-state=lost]")  # back to the first page, of the lost ones
    expect(rows(page)).to_have_count(1)
    expect(rows(page).first.locator("td").nth(1)).to_have_text("gpu07")
    assert "state=lost" in page.url  # the filter is in the URL: the view can be bookmarked
    page.click("#worker-state-filter button[data-state=busy]")
    expect(rows(page)).to_have_count(N // 3)
    page.fill("#filter-label", "zone=b")  # busy, zone b: every third worker of the odd ones
    expect(rows(page)).to_have_count(len([i for i in range(0, N, 3) if i % 2]))
    page.click("#worker-state-filter button[data-state='']")
    page.fill("#filter-free", "2")  # zone b with 2 free: the odd workers no job holds, gpu07 (lost) too
    expect(rows(page)).to_have_count(len([i for i in range(1, N, 2) if i % 3]))
    page.reload()  # the URL brings the same filter back
    expect(page.locator("#filter-label")).to_have_value("zone=b")
    expect(rows(page)).to_have_count(len([i for i in range(1, N, 2) if i % 3]))
