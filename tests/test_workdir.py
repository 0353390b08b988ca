"""Your own code, shipped with the job (issue 14): `trainjobs run` from a project folder, and the same through the
SDK, on a real stack. The project has its own `worker.py`, `utils.py`, `service/` and `model/`: its script
imports those, not ours, and still reports through `trainjobs.report`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import live_stack
from trainjobs import Client

TRAIN = '''\
"""A user's DDP script: its own modules, torch on gloo, the loss reported through trainjobs."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import service
import utils
import worker
from model import Net
from trainjobs import report, summary

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank}: {utils.WHO}, {worker.WHO}, {service.WHO}, cwd has train.py: {os.path.exists('train.py')}",
      flush=True)
torch.manual_seed(0)
model = DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 4)
y = x.sum(dim=1, keepdim=True)
for step in range(1, args.steps + 1):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    report(step=step, loss=loss.item(), total_steps=args.steps)
open("written-next-to-me.txt", "w").write("a run may write beside its script")
if rank == 0:
    summary(final_loss=loss.item(), steps=args.steps)
    print("project done", flush=True)
dist.destroy_process_group()
'''


def make_project(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "service").mkdir()
    (root / "train.py").write_text(TRAIN)
    (root / "model" / "__init__.py").write_text(
        "import torch\n\n\nclass Net(torch.nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n")
    (root / "utils.py").write_text("WHO = 'the project utils'\n")
    (root / "worker.py").write_text("WHO = 'the project worker'\n")
    (root / "service" / "__init__.py").write_text("WHO = 'the project service'\n")
    (root / "outputs").mkdir()
    (root / "outputs" / "big.bin").write_bytes(os.urandom(100_000))
    (root / ".trainjobsignore").write_text("outputs/\n")
    return root


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    with live_stack(postgres_url, tmp_path_factory.mktemp("workdir"), name="workdir", allow_entrypoints=True) as s:
        yield s


def trainjobs(stack, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRAINJOBS_API_URL=stack.api_url, TRAINJOBS_TOKEN=stack.token,
               XDG_CACHE_HOME=str(cwd.parent / "cache"))  # the CLI's digest cache: the test's own
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def test_trainjobs_run_ships_the_folder_and_the_script_imports_its_own_modules(stack, tmp_path):
    folder = make_project(tmp_path / "my-project")
    first = trainjobs(stack, folder, "run", "--nproc-per-node", "2", "--follow", "--json", "--", "train.py",
                      "--steps", "12")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "uploaded" in first.stderr and "nothing uploaded" not in first.stderr
    job = json.loads(first.stdout)
    assert job["status"] == "succeeded" and job["summary"]["steps"] == 12
    assert job["spec"]["entrypoint"]["package"].startswith("sha256:") and job["name"] == "train"
    with stack.client(timeout=10) as api:
        logs = api.get(f"/v1/jobs/{job['id']}/logs").text
        [loss] = api.get(f"/v1/jobs/{job['id']}/metrics", params={"name": "loss"}).json()["series"]
        package = api.get(f"/v1/packages/{job['spec']['entrypoint']['package']}").json()
    for rank in (0, 1):
        assert (f"rank {rank}: the project utils, the project worker, the project service, cwd has train.py: True"
                in logs), logs
    assert "project done" in logs
    assert loss["steps"] == list(range(1, 13)) and loss["values"][-1] < loss["values"][0]
    assert package["files"] == 8  # outputs/ left out by .trainjobsignore; no __pycache__ either

    again = trainjobs(stack, folder, "run", "--nproc-per-node", "2", "--json", "--", "train.py", "--steps", "3")
    assert again.returncode == 0, again.stderr
    assert "nothing uploaded" in again.stderr  # the same folder: the same digest, already there
    assert json.loads(again.stdout)["spec"]["entrypoint"]["package"] == job["spec"]["entrypoint"]["package"]

    dry = trainjobs(stack, folder, "run", "--dry-run", "--", "train.py")
    assert dry.returncode == 0 and json.loads(dry.stdout)["entrypoint"]["package"] == package["digest"]


def test_the_sdk_uploads_submits_waits_and_reads_the_metrics(stack, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = make_project(tmp_path / "sdk-project")
    (folder / "utils.py").write_text("WHO = 'the sdk utils'\n")  # another folder: another package
    with Client(stack.api_url, token=stack.token) as c:
        digest = c.upload_package(folder)
        assert c.last_upload is not None and c.last_upload.digest == digest
        assert c.upload_package(folder) == digest and c.last_upload is None  # the second time: nothing sent
        spec = {"name": "sdk", "resources": {"nproc_per_node": 2},
                "entrypoint": {"script": "train.py", "args": ["--steps", "5"]}, "env": {"MY_RUN": "sdk"}}
        submitted = c.submit(spec, workdir=folder)  # packs, finds it already uploaded, submits
        assert submitted["spec"]["entrypoint"]["package"] == digest and c.last_upload is None
        assert "package" not in spec["entrypoint"]  # the caller's dict is left as it was
        job = c.wait(submitted["id"], timeout=180)
        assert job["status"] == "succeeded", job["error"]
        [loss] = c.metrics(job["id"], name="loss")["series"]
        assert loss["steps"] == [1, 2, 3, 4, 5]
        assert "the sdk utils" in c.logs(job["id"])
        assert digest in [p["digest"] for p in c.packages()["data"]]


def test_a_job_with_requirements_is_refused_when_no_live_worker_installs_them(stack):
    """This stack's worker runs users' code without TRAINJOBS_ALLOW_PIP (tests/test_requirements.py: with)."""
    with stack.client() as api:
        response = api.post("/v1/jobs", json={"entrypoint": {"script": "t.py", "requirements": ["tomli-w"]}})
        workers = api.get("/v1/workers").json()
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == "entrypoint.requirements" and "TRAINJOBS_ALLOW_PIP=1" in body["detail"]
    assert workers["items"] and all("trainjobs.io/pip" not in w["labels"] for w in workers["items"])
