"""Retention (`trainjobs gc`): old finished jobs lose their logs, points, events, folders and objects in the store,
exactly those."""

import json
from datetime import timedelta

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, func, select, update
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.cli import main as cli
from service.db import utcnow
from service.jobs import retention
from service.jobs import service as jobs
from service.jobs.models import Job, JobEvent
from service.logs import service as logs
from service.logs.models import LogChunk
from service.metrics import service as metrics
from service.metrics.models import Metric, MetricBlock
from service.settings import Settings, get_settings
from service.storage import DirectoryStore, StoreUnavailable, artifact_key, job_prefix, open_store
from service.storage.store import checkpoint_key, manifest_key, package_key, part_key
from tests.conftest import admin_token, mlp_spec
from tests.helpers import wait_for
from tests.s3 import moto_s3
from trainjobs.paths import job_dir
from trainjobs.spec import JobSpec


def add_job(db: Session, storage, *, status: str, finished_days_ago: float | None, steps: int = 50) -> str:
    job_id = jobs.create(db, spec=JobSpec.model_validate(mlp_spec())).id
    finished = utcnow() - timedelta(days=finished_days_ago) if finished_days_ago is not None else None
    db.execute(update(Job).where(Job.id == job_id).values(status=status, finished_at=finished))
    logs.append(db, job_id=job_id, attempt=1, start=0, seq=0, text="step 1\n")
    metrics.insert_batch(db, job_id=job_id, attempt=1, rows=[(s, "loss", 1 / (s + 1), utcnow()) for s in range(steps)])
    db.commit()
    folder = job_dir(storage, job_id) / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step_10.pt").write_bytes(b"x" * 10)
    return job_id


def left(db: Session, job_id: str, storage) -> dict[str, int]:
    counts = {name: db.scalar(select(func.count()).select_from(table).where(table.job_id == job_id))
              for name, table in (("logs", LogChunk), ("points", Metric), ("events", JobEvent),
                                  ("blocks", MetricBlock))}
    return {**counts, "folder": int(job_dir(storage, job_id).exists())}


def test_gc_deletes_exactly_the_old_finished_jobs_rows_and_files_never_a_live_jobs(db_url, tmp_path):
    engine, storage = create_engine(db_url), tmp_path / "storage"
    with Session(engine) as db:
        old = [add_job(db, storage, status=s, finished_days_ago=40) for s in ("succeeded", "failed", "cancelled")]
        recent = add_job(db, storage, status="succeeded", finished_days_ago=1)
        running = add_job(db, storage, status="running", finished_days_ago=None)
        stale = add_job(db, storage, status="running", finished_days_ago=40)  # a live job, whatever its time says
        kept = {job_id: left(db, job_id, storage) for job_id in [*old, recent, running, stale]}
        assert all(v["logs"] and v["points"] and v["events"] and v["blocks"] and v["folder"] for v in kept.values())
        cutoff = utcnow() - timedelta(days=30)
        dry = retention.collect(db, cutoff=cutoff, storage_dir=storage, dry_run=True, batch=2)
        assert {job_id: left(db, job_id, storage) for job_id in kept} == kept  # a dry run deletes nothing
        done = retention.collect(db, cutoff=cutoff, storage_dir=storage, batch=2)
        assert done == dry and done.jobs == 3 and done.folders == 3
        assert done.metric_points == 150 and done.log_chunks == 3 and done.events == 3
        for job_id in old:
            assert left(db, job_id, storage) == {"logs": 0, "points": 0, "events": 0, "blocks": 1, "folder": 0}
            assert db.get(Job, job_id) is not None  # the job itself stays
        for job_id in (recent, running, stale):
            assert left(db, job_id, storage) == kept[job_id]
        assert retention.collect(db, cutoff=cutoff, storage_dir=storage).jobs == 0  # nothing left to do
    engine.dispose()


def test_a_collection_cut_short_goes_on_where_it_stopped(db_url, tmp_path):
    engine, storage = create_engine(db_url), tmp_path / "storage"
    with Session(engine) as db:
        old = sorted(add_job(db, storage, status="succeeded", finished_days_ago=40) for _ in range(3))
        cutoff = utcnow() - timedelta(days=30)
        first = retention.collect(db, cutoff=cutoff, storage_dir=storage, batch=1, max_batches=2)
        assert first.jobs == 2 and first.resume_after == old[1] and left(db, old[2], storage)["points"] == 50
        rest = retention.collect(db, cutoff=cutoff, storage_dir=storage, batch=1, max_batches=2,
                                 after=first.resume_after)
        assert rest.jobs == 1 and rest.resume_after is None and left(db, old[2], storage)["points"] == 0
    engine.dispose()


def test_an_old_jobs_chart_still_draws_from_its_summaries(client, settings):
    storage = settings.resolved_storage_dir
    engine = create_engine(settings.database_url)
    with Session(engine) as db:
        job_id = add_job(db, storage, status="succeeded", finished_days_ago=40, steps=1000)
    url = f"/v1/jobs/{job_id}/metrics"
    before = client.get(url, params={"max_points": 500}).json()["series"][0]
    with Session(engine) as db:
        retention.collect(db, cutoff=utcnow() - timedelta(days=30), storage_dir=storage)
    engine.dispose()
    after = client.get(url, params={"max_points": 500}).json()["series"][0]
    assert before["name"] == after["name"] == "loss" and before["steps"][-1] == 999
    assert after["steps"][-1] == 999 and 0 < len(after["steps"]) <= 500  # coarser, from the block summaries
    assert max(after["values"]) == max(before["values"]) and min(after["values"]) == min(before["values"])
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"


def test_trainjobs_gc_dry_run_prints_what_would_go(db_url, tmp_path, monkeypatch, capsys):
    storage = tmp_path / "storage"
    engine = create_engine(db_url)
    with Session(engine) as db:
        add_job(db, storage, status="succeeded", finished_days_ago=10)
    engine.dispose()
    monkeypatch.setenv("TRAINJOBS_DATABASE_URL", db_url)
    monkeypatch.setenv("TRAINJOBS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRAINJOBS_STORAGE_DIR", str(storage))
    get_settings.cache_clear()
    try:
        assert cli.main(["gc", "--older-than", "7d", "--dry-run", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["dry_run"] and out["jobs"] == 1 and out["metric_points"] == 50 and out["folders"] == 1
        assert cli.main(["gc", "--json"]) == 0  # default: 30 days, so nothing of a 10-day-old job
        assert json.loads(capsys.readouterr().out)["jobs"] == 0
    finally:
        get_settings.cache_clear()


def test_with_retention_days_set_the_sweeper_collects_and_metrics_count_it(settings, redis):
    settings = settings.model_copy(update={"retention_days": 30})
    engine = create_engine(settings.database_url)
    with Session(engine) as db:
        add_job(db, settings.resolved_storage_dir, status="succeeded", finished_days_ago=40)
        add_job(db, settings.resolved_storage_dir, status="succeeded", finished_days_ago=5)
    engine.dispose()
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(settings)}"

        def deleted() -> dict[str, float]:
            return {s.labels["kind"]: s.value for f in text_string_to_metric_families(c.get("/metrics").text)
                    if f.name == "trainjobs_gc_deleted" for s in f.samples if s.name.endswith("_total")}

        got = wait_for(lambda: deleted().get("jobs") == 1 and deleted(), timeout=10, what="the sweeper's collection")
    assert got["metric_points"] == 50 and got["log_chunks"] == 1 and got["folders"] == 1


def put_objects(store, job_id: str) -> list[str]:
    """A job's objects of each kind: a checkpoint's file, its gang part, its manifest, an artifact."""
    keys = [checkpoint_key(job_id, "step_00000010", "__0_0.distcp"), part_key(job_id, "step_00000010", 1),
            manifest_key(job_id, "step_00000010"), artifact_key(job_id, "model.pt")]
    for key in keys:
        store.put_bytes(key, b"x")
    return keys


def test_gc_deletes_an_old_jobs_objects_in_the_store_and_keeps_a_younger_ones(db_url, tmp_path, monkeypatch, capsys):
    storage, engine = tmp_path / "storage", create_engine(db_url)
    with moto_s3("trainjobs-retention"), Session(engine) as db:
        url = f"s3://trainjobs-retention/gc-{tmp_path.name}"
        store = open_store(Settings(storage_url=url))
        old = add_job(db, storage, status="succeeded", finished_days_ago=40)
        young = add_job(db, storage, status="succeeded", finished_days_ago=1)
        kept = {job_id: put_objects(store, job_id) for job_id in (old, young)}
        package = package_key("sha256:" + "ab" * 32)  # shared by digest: never a job's to delete
        store.put_bytes(package, b"tar")
        monkeypatch.setenv("TRAINJOBS_DATABASE_URL", db_url)
        monkeypatch.setenv("TRAINJOBS_DATA_DIR", str(tmp_path))
        monkeypatch.setenv("TRAINJOBS_STORAGE_DIR", str(storage))
        monkeypatch.setenv("TRAINJOBS_STORAGE_URL", url)
        get_settings.cache_clear()
        capsys.readouterr()  # moto's own line
        try:
            assert cli.main(["gc", "--older-than", "7d", "--dry-run", "--json"]) == 0
            dry = json.loads(capsys.readouterr().out)
            assert dry["jobs"] == 1 and dry["store_objects"] == 4 and dry["folders"] == 1
            assert sorted(o.key for o in store.list(job_prefix(old))) == sorted(kept[old])  # a dry run deletes none
            assert cli.main(["gc", "--older-than", "7d", "--json"]) == 0
            done = json.loads(capsys.readouterr().out)
        finally:
            get_settings.cache_clear()
        assert {k: v for k, v in done.items() if k != "dry_run"} == {k: v for k, v in dry.items() if k != "dry_run"}
        assert store.list(job_prefix(old)) == [] and not job_dir(storage, old).exists()
        assert sorted(o.key for o in store.list(job_prefix(young))) == sorted(kept[young])
        assert store.head(package) is not None
    engine.dispose()


class DeleteRefused(DirectoryStore):
    """A store that refuses its first delete (an outage as retention runs), then answers."""

    refusals = 1

    def delete(self, keys):
        if self.refusals:
            self.refusals -= 1
            raise StoreUnavailable(f"the store {self.url} is unreachable (delete): connection refused")
        super().delete(keys)


def test_a_store_delete_that_failed_is_retried_by_the_next_run(db_url, tmp_path):
    storage, engine = tmp_path / "storage", create_engine(db_url)
    store = DeleteRefused(tmp_path / "store")
    store.root.mkdir()
    with Session(engine) as db:
        old = add_job(db, storage, status="succeeded", finished_days_ago=40)
        put_objects(store, old)
        cutoff = utcnow() - timedelta(days=30)
        first = retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store)
        assert first.jobs == 1 and first.metric_points == 50 and first.store_objects == 0  # rows go all the same
        assert len(store.list(job_prefix(old))) == 4
        second = retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store)
        assert second.jobs == 1 and second.store_objects == 4 and second.metric_points == 0
        assert store.list(job_prefix(old)) == []
        assert retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store).jobs == 0
    engine.dispose()


class Counting(DeleteRefused):
    """DeleteRefused that counts the listings asked of it."""

    listings = 0

    def list(self, prefix):
        self.listings += 1
        return super().list(prefix)


def test_a_collected_job_is_marked_and_later_runs_ask_the_store_nothing_of_it(db_url, tmp_path):
    storage, engine = tmp_path / "storage", create_engine(db_url)
    store = Counting(tmp_path / "store")
    store.root.mkdir()
    with Session(engine) as db:
        old = [add_job(db, storage, status="succeeded", finished_days_ago=40) for _ in range(2)]
        for job_id in old:
            put_objects(store, job_id)
        cutoff = utcnow() - timedelta(days=30)
        # The store fails the first batch's delete: no job of this run is marked, not even the second batch's,
        # whose objects the run no longer asked the store about.
        retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store, batch=1)
        assert [db.get(Job, j, populate_existing=True).collected_at for j in old] == [None, None]
        assert all(len(store.list(job_prefix(j))) == 4 for j in old)
        second = retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store, batch=1)
        assert second.store_objects == 8 and all(store.list(job_prefix(j)) == [] for j in old)
        assert all(db.get(Job, j, populate_existing=True).collected_at is not None for j in old)
        store.listings = 0
        third = retention.collect(db, cutoff=cutoff, storage_dir=storage, store=store)
        assert third.jobs == 0 and store.listings == 0  # collected jobs cost a later run nothing
    engine.dispose()
