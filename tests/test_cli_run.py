"""`trainjobs run [flags] -- script ARGS`: the spec the flags make, checked before anything is sent."""

import json

import pytest

from service.cli import main as cli
from service.cli.run import make_spec


def parse(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


def test_flags_make_an_entrypoint_spec_for_the_script_and_its_arguments():
    spec = make_spec(parse("--nproc-per-node", "2", "--nnodes", "2", "--name", "exp1", "--priority", "high",
                           "--env", "WANDB_MODE=offline", "--env", "EMPTY=", "--max-retries", "2", "--timeout", "600",
                           "--tag", "team=nlp", "--", "train.py", "--lr", "3e-4", "--", "x"))
    assert spec == {
        "name": "exp1", "strategy": "ddp", "priority": "high", "max_retries": 2, "timeout_s": 600.0,
        "resources": {"nnodes": 2, "nproc_per_node": 2, "device": "cpu"},
        "entrypoint": {"script": "train.py", "args": ["--lr", "3e-4", "--", "x"]},
        "env": {"WANDB_MODE": "offline", "EMPTY": ""}, "tags": ["team=nlp"],
    }


def test_without_a_double_dash_and_with_a_module():
    assert make_spec(parse("sub/train.py", "--epochs", "2"))["entrypoint"] == {"script": "sub/train.py",
                                                                               "args": ["--epochs", "2"]}
    assert make_spec(parse("sub/train.py"))["name"] == "train"
    spec = make_spec(parse("--module", "my_pkg.train", "--", "--lr", "1"))
    assert spec["entrypoint"] == {"module": "my_pkg.train", "args": ["--lr", "1"]} and spec["name"] == "train"


def test_a_bad_flag_is_an_error_naming_the_field_before_anything_is_sent(capsys):
    assert cli.main(["run", "--nproc-per-node", "0", "--no-workdir", "--dry-run", "--", "train.py"]) == 2
    assert "resources.nproc_per_node" in capsys.readouterr().out
    assert cli.main(["run", "--env", "LD_PRELOAD=/x.so", "--no-workdir", "--dry-run", "--", "train.py"]) == 2
    assert "LD_PRELOAD" in capsys.readouterr().out
    assert cli.main(["run", "--no-workdir", "--dry-run"]) == 2
    assert "name the script to run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse("--env", "NOVALUE", "train.py")


def test_dry_run_prints_the_spec_and_sends_nothing(capsys, monkeypatch):
    monkeypatch.setenv("TRAINJOBS_API_URL", "http://127.0.0.1:9")  # nothing listens: a request would fail
    assert cli.main(["run", "--no-workdir", "--dry-run", "--", "train.py", "--lr", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["entrypoint"] == {"script": "train.py", "args": ["--lr", "1"]}


def test_a_spec_the_pool_refuses_is_refused_before_the_folder_is_uploaded(client, settings, capsys, tmp_path,
                                                                          monkeypatch):
    from service.db import make_engine, make_sessionmaker
    from tests.test_pending import add_worker
    from trainjobs.client import Client

    monkeypatch.setenv("TRAINJOBS_CONFIG", str(tmp_path / "config.toml"))
    engine = make_engine(settings.database_url)
    with make_sessionmaker(engine)() as db:
        add_worker(db, "closed", slots=2)  # runs no users' own code
        db.commit()
    engine.dispose()
    (tmp_path / "train.py").write_text("print('hi')\n")
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app, with the admin token
    argv = ["run", "--workdir", str(tmp_path), "--", "train.py"]
    assert cli.main(argv, client=api) == 2
    out = capsys.readouterr()
    assert out.out.startswith("error: HTTP 403: entrypoint: no live worker runs users' own code") and \
        "uploaded" not in out.err, out
    assert client.get("/v1/packages").json()["count"] == 0  # nothing was sent
    assert client.get("/v1/jobs").json()["items"] == []
    dry = client.post("/v1/jobs:validate", json={"entrypoint": {"script": "train.py"}},
                      params={"allow_unschedulable": "true"})
    assert dry.status_code == 200 and dry.json()["entrypoint"]["script"] == "train.py", dry.text
    assert client.get("/v1/jobs").json()["items"] == []  # a dry submit makes no job
    # Told it will wait for such a worker, it is taken (a script the workers have: the TestClient uploads nothing).
    assert cli.main(["run", "--no-workdir", "--allow-unschedulable", "--", "train.py"], client=api) == 0
    [job] = client.get("/v1/jobs").json()["items"]
    assert job["status"] == "queued" and f"submitted {job['id']}" in capsys.readouterr().out
