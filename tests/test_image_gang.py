"""A two-node gang whose nodes both run in an image (issue 44): two 1-slot workers, c10d rendezvous, gloo, the
built-in runtime on the image's own Python and torch (tests/image_build.py's torch image, ~1 GB unpacked: built
once per machine, pulled once per test run).

Its losses equal a 1-node 2-process run of the same spec on the worker's own Python: the image changes where the
code comes from, not what it computes.
"""

import time

import pytest

from tests.conftest import mlp_spec
from tests.helpers import live_stack, run_torchrun, wait_for, wait_terminal
from tests.image_build import needs_sandbox, needs_tools, serving_registry


@pytest.fixture(scope="module")
def torch_registry(tmp_path_factory):
    """A registry serving the torch image: (host:port, its log)."""
    from tests import image_build

    layout = image_build.build_torch()
    with serving_registry(tmp_path_factory.mktemp("torch-registry"), {"test/torch:1": f"{layout}:image"}) as served:
        yield served


@needs_tools
@needs_sandbox
def test_a_two_node_gang_runs_in_its_image_and_matches_the_workers_python(torch_registry, postgres_url,
                                                                            tmp_path_factory, tmp_path):
    where, _ = torch_registry
    image = f"{where}/test/torch:1"
    spec = mlp_spec(name="image-gang", image=image, resources={"nnodes": 2, "nproc_per_node": 1, "device": "cpu"},
                    train={"max_steps": 20, "log_every": 5, "seed": 0})
    with live_stack(postgres_url, tmp_path_factory.mktemp("gang-data"), name="image-gang", workers=0,
                    image_insecure_registries=where, lease_s=8.0, heartbeat_s=0.5, sweep_s=0.5,
                    gang_timeout_s=120.0) as stack, stack.client(timeout=10) as api:
        stack.add_workers(2, args=["--slots", "1"])
        wait_for(lambda: len(api.get("/v1/workers").json()["items"]) >= 2, 30, what="two workers")
        started = time.monotonic()
        job_id = api.post("/v1/jobs", json=spec).json()["id"]
        job = wait_terminal(api, job_id, timeout=400)
        took_s = time.monotonic() - started
        logs = [api.get(f"/v1/jobs/{job_id}/logs", params={"node_rank": r}).text for r in (0, 1)]
        assert job["status"] == "succeeded", (job["error"], [text[-2000:] for text in logs])

        nodes = api.get(f"/v1/jobs/{job_id}/attempts").json()["data"]
        assert sorted(a["node_rank"] for a in nodes) == [0, 1] and nodes[0]["worker"] != nodes[1]["worker"]
        resolved = api.get(f"/v1/jobs/{job_id}/image").json()["resolved"]
        assert sorted(r["node_rank"] for r in resolved) == [0, 1]  # both nodes ran the image: one digest
        assert len({r["digest"] for r in resolved}) == 1 and resolved[0]["digest"].startswith("sha256:")

        gang_loss = api.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["series"][0]
        single = {**spec, "resources": {"nnodes": 1, "nproc_per_node": 2, "device": "cpu"}}
        single.pop("image")
        records = [r for r in run_torchrun(single, tmp_path / "single") if r["type"] == "metrics"]
        assert gang_loss["steps"] == [r["step"] for r in records] == [5, 10, 15, 20]
        assert gang_loss["values"] == pytest.approx([r["metrics"]["loss"] for r in records], abs=1e-5)
        pulls = [r["pulled_s"] for r in resolved]
        print(f"2-node gang in a {image} image: submitted to succeeded in {took_s:.1f}s, pulls {pulls}")
