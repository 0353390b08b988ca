"""The memory plan through the API (POST /v1/plan, auto jobs, GET shows the plan) and the workers' memory (table)."""

import json
import os
import stat
from datetime import timedelta

from sqlalchemy import create_engine, update

from service.cli import main as cli
from service.db import make_engine, make_sessionmaker, utcnow
from service.jobs.models import Job
from service.workers import service as workers
from service.workers import service as workers_service
from service.workers.models import Worker
from tests.conftest import mlp_spec
from tests.helpers import count_jobs
from trainjobs.client import Client
from worker import inventory

BIG_GPT = {"type": "gpt", "n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 50257}


def big_gpt_spec(gpu_memory_gb: float, **overrides) -> dict:
    overrides = {"strategy": "auto", **overrides}
    return mlp_spec(model=BIG_GPT, data={"type": "synthetic_lm", "batch_size": 8},
                    resources={"nproc_per_node": 4, "device": "cuda", "gpu_memory_gb": gpu_memory_gb}, **overrides)


def test_plan_returns_both_estimates_the_choice_and_the_reason_without_a_job(client, settings):
    r = client.post("/v1/plan", json=big_gpt_spec(40))
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["choice"] == plan["strategy"] == "fsdp" and "only FSDP fits" in plan["reason"]
    assert plan["ddp"]["total_gib"] > 32 >= plan["fsdp"]["total_gib"] and plan["limit_gib"] == 32
    assert plan["device_memory_gib"] == 40 and plan["device_memory_source"] == "spec"
    assert set(plan["fsdp"]["breakdown"]) == {"parameters", "gradients", "optimizer", "gathered_parameters",
                                              "unsharded_gradients", "activations"}
    assert plan["parameters"] == 24 * (12 * 2048**2 + 13 * 2048) + 2 * 50257 * 2048 + 1024 * 2048 + 2 * 2048
    assert count_jobs(settings.database_url) == 0


def test_plan_of_a_spec_that_fits_nowhere_is_an_answer_not_an_error(client):
    r = client.post("/v1/plan", json=big_gpt_spec(24))
    assert r.status_code == 200
    assert r.json()["choice"] is None and r.json()["strategy"] is None and r.json()["suggestions"]


def test_plan_refuses_bad_input_naming_the_field(client):
    r = client.post("/v1/plan", json=mlp_spec(optimizer={"lr": -1}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["optimizer", "lr"]
    entrypoint = mlp_spec(model=None, data=None, entrypoint={"module": "my_train"})
    r = client.post("/v1/plan", json=entrypoint)
    assert r.status_code == 422 and r.json()["field"] == "model"


def test_auto_job_is_stored_with_the_chosen_strategy_and_shows_its_plan(client):
    created = client.post("/v1/jobs", json=mlp_spec(strategy="auto"))
    assert created.status_code == 201, created.text
    job = client.get(f"/v1/jobs/{created.json()['id']}").json()
    assert job["spec"]["strategy"] == "ddp"  # the worker never sees "auto"
    assert job["plan"]["requested"] == "auto" and job["plan"]["choice"] == "ddp"
    assert job["plan"]["device"] == "cpu" and job["plan"]["ddp"]["breakdown"]["parameters"] == 4 * (16 * 17 + 17)
    assert job["memory"] == {"estimated_mb": round(job["plan"]["ddp"]["total_bytes"] / 2**20, 3),
                             "measured_peak_mb": None}


def test_auto_job_picks_fsdp_when_only_the_shards_fit(client):
    job = client.post("/v1/jobs", json=big_gpt_spec(40)).json()
    assert job["spec"]["strategy"] == "fsdp" and job["plan"]["choice"] == "fsdp"
    assert job["memory"]["estimated_mb"] == round(job["plan"]["fsdp"]["total_bytes"] / 2**20, 3)


def test_auto_job_that_fits_nowhere_is_422_naming_strategy_and_the_memory_needed(client, settings):
    r = client.post("/v1/jobs", json=big_gpt_spec(24))
    assert r.status_code == 422 and r.json()["field"] == "strategy"
    detail = r.json()["detail"]
    assert "nothing fits" in detail and "GiB per device" in detail and "nproc_per_node" in detail
    assert "activation_checkpointing" in detail
    assert count_jobs(settings.database_url) == 0


def test_explicit_strategy_is_never_refused_by_the_plan(client):
    spec = big_gpt_spec(1, strategy="ddp")
    job = client.post("/v1/jobs", json=spec).json()
    assert job["spec"]["strategy"] == "ddp" and job["plan"]["requested"] == "ddp" and job["plan"]["choice"] is None


def test_entrypoint_job_has_no_plan(client):
    job = client.post("/v1/jobs", json=mlp_spec(model=None, data=None, entrypoint={"module": "my_train"})).json()
    assert job["plan"] is None and job["memory"] is None


def test_the_measured_peak_is_shown_beside_the_estimate(client, settings):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    engine = create_engine(settings.database_url)
    with engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == job["id"]).values(summary={"peak_mem_mb": 123.5}))
    engine.dispose()
    memory = client.get(f"/v1/jobs/{job['id']}").json()["memory"]
    assert memory["measured_peak_mb"] == 123.5 and memory["estimated_mb"] > 0


def fake_nvidia_smi(folder, output: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_worker_memory_round_trip_through_the_workers_table(settings, tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, "81559\\n40960\\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    offer = inventory.probe(settings, name="gpu-box-1")
    stop = inventory.start_heartbeat(sessions, offer=offer, every_s=60, draining=lambda: False)
    try:
        with sessions() as db:
            found = workers_service.live_memory(db, lost_after_s=settings.lease_s)
        assert len(found) == 1 and found[0].device == "cuda" and found[0].gpu_count == 2
        assert found[0].gpu_memory_bytes == 40960 * 2**20 and found[0].host_memory_bytes > 0
    finally:
        stop()
    with sessions() as db:
        assert workers_service.live_memory(db, lost_after_s=settings.lease_s) == []  # a clean stop leaves at once
    engine.dispose()


def test_a_machine_without_nvidia_smi_reports_no_gpu(settings, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert inventory.gpu_memory() == (0, None)
    offer = inventory.probe(settings, name="w")
    assert offer.device == "cpu" and offer.slots == (os.cpu_count() or 1) and offer.memory_bytes > 0


def test_the_plan_uses_the_smallest_live_workers_memory(client, settings):
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        for name, gib in (("a", 80), ("b", 24), ("gone", 8)):
            workers.register(db, worker_id=name, host=name, address="10.0.0.1", device="cuda", slots=8,
                             memory_bytes=gib * 2**30, host_memory_bytes=2**40, labels={})
        db.flush()
        db.execute(update(Worker).where(Worker.id == "gone").values(
            last_seen=utcnow() - timedelta(seconds=settings.lease_s + 1)))  # lost: not counted
        db.commit()
    engine.dispose()
    spec = big_gpt_spec(1)
    del spec["resources"]["gpu_memory_gb"]
    plan = client.post("/v1/plan", json=spec).json()
    assert plan["device_memory_source"] == "workers" and plan["device_memory_gib"] == 24 and plan["choice"] is None


def test_cli_plan_prints_both_estimates_and_the_choice(client, tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(big_gpt_spec(40)))
    api = Client("http://testserver")
    api.http = client  # a TestClient is an httpx.Client on the app
    assert cli.cmd_plan(cli.build_parser().parse_args(["plan", str(path)]), api) == 0
    out = capsys.readouterr().out
    assert "gathered_parameters" in out and "choice: fsdp" in out and "only FSDP fits" in out


def test_a_job_with_an_auto_batch_is_stored_with_the_batch_its_plan_picked(client):
    spec = big_gpt_spec(80, strategy="ddp")
    spec["data"]["batch_size"] = "auto"
    created = client.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = client.get(f"/v1/jobs/{created.json()['id']}").json()
    size = job["spec"]["data"]["batch_size"]  # the worker never sees "auto"
    assert isinstance(size, int) and size == job["plan"]["batch_size"] and size >= 1
    assert job["plan"]["reason"].startswith(f"data.batch_size auto: {size} per rank")
    bad = client.post("/v1/jobs", json=mlp_spec(data={"type": "synthetic_regression", "batch_size": "most"}))
    assert bad.status_code == 422 and "batch_size" in bad.text
