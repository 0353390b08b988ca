"""What a user's files and a job's outputs look like from the CLI: a spec with a syntax error is one line naming
the file, line and column; `metrics` lists the series there are (and a wrong --name says which); `download`
makes the folder it saves into."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.artifacts.service import artifacts_dir
from service.db import make_engine, make_sessionmaker, utcnow
from service.metrics import service as metrics
from tests.conftest import mlp_spec
from tests.test_cli_ids import no_user_config, run  # noqa: F401 - the fixture, used by every test here
from trainjobs.client import Client

ROOT = Path(__file__).resolve().parent.parent
DEAD_API = "http://127.0.0.1:9"  # nothing listens: a file's mistake must be found before any request


def trainjobs(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINJOBS_API_URL": DEAD_API, "TRAINJOBS_CONFIG": str(cwd / "config.toml"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("name", "text", "where", "why"), [
    ("bad.yaml", "name: x\nresources:\n  nproc_per_node: [1\n", "bad.yaml:4:1:",
     "not valid YAML: while parsing a flow sequence (from line 3, column 19), expected ',' or ']'"),
    ("tabs.yml", "name: x\nstrategy: ddp: fsdp\n", "tabs.yml:2:14:", "not valid YAML: mapping values are not allowed"),
    ("bad.json", '{"name": "x",\n  "strategy": }\n', "bad.json:2:15:", "not valid JSON: Expecting value"),
    ("list.yaml", "- name: x\n", "list.yaml:", "a job spec is a mapping of its fields"),
    ("empty.yaml", "", "empty.yaml:", "the file is empty"),
])
def test_a_spec_with_a_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path, name, text, where, why):
    (tmp_path / name).write_text(text)
    for command in ("submit", "plan"):
        done = trainjobs(command, name, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr == ""
        assert done.stdout.startswith(f"error: {where} ") and why in done.stdout, done.stdout
        assert done.stdout.count("\n") == 1  # one line, even past 80 columns


def test_a_sweep_file_with_a_syntax_error_is_one_line_too(tmp_path):
    (tmp_path / "sweep.yaml").write_text("name: s\nparameters:\n  lr: {values: [1, 2}\n")
    done = trainjobs("sweep", "sweep.yaml", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout.startswith("error: sweep.yaml:3:")
    assert done.stdout.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.fixture
def job_with_metrics(client, settings) -> str:
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        rows = [(s, name, value / s, utcnow()) for s in (5, 10, 15) for name, value in (("loss", 3.0), ("lr", 0.1))]
        metrics.insert_batch(db, job_id=job_id, attempt=1, rows=rows)
        db.commit()
    engine.dispose()
    return job_id


def test_metrics_without_a_name_lists_each_series_with_its_last_step_and_value(client, capsys, job_with_metrics):
    out, _ = run(client, capsys, "metrics", job_with_metrics)
    header, loss, lr = out.splitlines()
    assert header.split() == ["metric", "last", "step", "last", "min", "max", "points"]
    assert loss.split() == ["loss", "15", "0.2", "0.2", "0.6", "3"]
    assert lr.split() == ["lr", "15", "0.00666667", "0.00666667", "0.02", "3"]


def test_a_metric_name_the_job_lacks_says_which_names_it_has(client, capsys, job_with_metrics):
    for extra in ((), ("--csv",)):
        out, _ = run(client, capsys, "metrics", job_with_metrics, "--name", "losss", *extra, code=2)
        assert out == (f"error: job {job_with_metrics} has no metric 'losss'; did you mean 'loss'? Its metrics: "
                       "loss, lr\n")
    out, _ = run(client, capsys, "metrics", job_with_metrics, "--name", "lr")
    assert [line.split()[0] for line in out.splitlines()] == ["metric", "lr"]


def test_metrics_of_a_job_with_none_yet_says_so(client, capsys):
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    out, _ = run(client, capsys, "metrics", job_id)
    assert out == f"job {job_id} has no metrics yet\n"
    out, _ = run(client, capsys, "metrics", job_id, "--name", "loss", code=2)
    assert "has no metrics yet" in out


@pytest.fixture
def job_with_artifacts(client, settings) -> str:
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    folder = artifacts_dir(settings, job_id)
    (folder / "plots").mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    (folder / "plots" / "loss.png").write_bytes(b"png")
    return job_id


def test_download_saves_every_artifact_into_a_folder_it_makes(client, capsys, job_with_artifacts, tmp_path):
    out, err = run(client, capsys, "download", job_with_artifacts, "--to", str(tmp_path / "new" / "out"))
    assert (tmp_path / "new" / "out" / "model.pt").read_bytes() == b"weights"
    assert (tmp_path / "new" / "out" / "plots" / "loss.png").read_bytes() == b"png"
    assert f"saved {tmp_path / 'new' / 'out' / 'model.pt'} (7 bytes)" in err
    run(client, capsys, "download", job_with_artifacts, "model.pt", "--to", str(tmp_path / "one"))
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.pt"]
    out, _ = run(client, capsys, "download", job_with_artifacts, "modle.pt", "--to", str(tmp_path / "x"), code=2)
    assert "has no artifact 'modle.pt'; it has: model.pt, plots/loss.png" in out
    assert not (tmp_path / "x").exists()


def test_the_sdk_downloads_into_a_missing_folder_named_with_a_slash(client, job_with_artifacts, tmp_path,
                                                                     monkeypatch):
    api = Client("http://testserver")
    api.http = client
    monkeypatch.chdir(tmp_path)
    assert api.download(job_with_artifacts, "model.pt", "out/") == Path("out/model.pt")
    assert (tmp_path / "out" / "model.pt").read_bytes() == b"weights"
    saved = api.download(job_with_artifacts, "plots/loss.png", tmp_path / "deep" / "named.png")  # a file: its folder
    assert saved.read_bytes() == b"png"
    with pytest.raises(Exception, match="404"):
        api.download(job_with_artifacts, "nope.pt", "missing/")
    assert not (tmp_path / "missing").exists()  # no folder for a file the API does not have
