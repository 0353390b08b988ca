"""Issue 41, what the host gives a job and what a job can learn of the host: a gang's network is a right an admin
grants, an attempt's pids are a share of the host's, and nothing a job sees or asks names another job."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from service.api.app import create_app
from service.cli import main as cli
from service.db import make_engine, make_private_dir
from service.settings import Settings
from tests.conftest import admin_token, mlp_spec
from trainjobs.client import Client
from worker import cgroups, sandbox

GANG = {"nnodes": 2, "nproc_per_node": 1, "device": "cpu"}


def user(client, name: str, **fields) -> dict:
    r = client.post("/v1/tokens", json={"name": name, **fields})
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


# 1. A gang's network: the right to run one.

def test_a_gang_from_a_user_without_the_right_is_a_403_naming_nnodes_and_who_grants_it(client):
    eve = user(client, "eve")
    refused = client.post("/v1/jobs", json=mlp_spec(resources=GANG), headers=eve)
    assert refused.status_code == 403, refused.text
    body = refused.json()
    assert body["field"] == "resources.nnodes" and "admin" in body["detail"] and "--multinode" in body["detail"]
    assert client.post("/v1/jobs:validate", json=mlp_spec(resources=GANG), headers=eve).status_code == 403
    assert client.get("/v1/jobs", headers=eve).json()["items"] == []
    assert client.get("/v1/me", headers=eve).json()["multinode"] is False
    # One node is everyone's; an admin's own gang is admitted.
    assert client.post("/v1/jobs", json=mlp_spec(), headers=eve).status_code == 201
    assert client.post("/v1/jobs", json=mlp_spec(resources=GANG)).status_code == 201


def test_an_admin_grants_and_withdraws_the_right_and_the_users_listing_shows_it(client):
    eve = user(client, "eve")
    assert client.patch("/v1/users/eve", json={"multinode": True}, headers=eve).status_code == 403
    granted = client.patch("/v1/users/eve", json={"multinode": True})
    assert granted.status_code == 200 and granted.json()["multinode"] is True
    assert client.get("/v1/users/eve", headers=eve).json()["multinode"] is True
    assert client.get("/v1/me", headers=eve).json()["multinode"] is True
    assert client.post("/v1/jobs", json=mlp_spec(resources=GANG), headers=eve).status_code == 201  # no cache lag
    assert client.patch("/v1/users/eve", json={"multinode": False}).json()["multinode"] is False
    assert client.post("/v1/jobs", json=mlp_spec(resources=GANG), headers=eve).status_code == 403
    ann = user(client, "ann", multinode=True)  # at token creation, as can_run_entrypoints
    assert client.post("/v1/jobs", json=mlp_spec(resources=GANG), headers=ann).status_code == 201


def test_an_operator_may_make_gangs_everyones_right(settings, redis):
    settings = settings.model_copy(update={"multinode_for_all": True})
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
        eve = user(client, "eve")
        assert client.post("/v1/jobs", json=mlp_spec(resources=GANG), headers=eve).status_code == 201
        assert client.get("/v1/me", headers=eve).json()["multinode"] is True


def test_the_cli_grants_the_right_and_says_so(client, capsys):
    user(client, "eve")
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app, with the admin token
    args = cli.build_parser().parse_args(["user", "set", "eve", "--multinode"])
    assert args.remote(args, api) == 0
    assert "multinode yes" in capsys.readouterr().out
    assert client.get("/v1/users/eve").json()["multinode"] is True
    args = cli.build_parser().parse_args(["token", "create", "ann", "--multinode"])
    assert args.remote(args, api) == 0
    assert client.get("/v1/users/ann").json()["multinode"] is True


def test_the_workers_labels_say_what_a_gang_gets():
    on = sandbox.Support("/usr/bin/bwrap", True, "v2", "private")
    assert on.labels()["trainjobs.io/sandbox-gang-net"] == "host"
    assert sandbox.Support(None, False, None, "host").labels()["trainjobs.io/sandbox-gang-net"] == "host"


# 2. Bounds sized to the host.

def test_an_attempts_pids_are_a_share_of_the_hosts_and_of_a_capped_parent(tmp_path, monkeypatch):
    pid_max = tmp_path / "pid_max"
    pid_max.write_text("32768\n")
    monkeypatch.setattr(cgroups, "PID_MAX", pid_max)
    monkeypatch.setattr(cgroups, "_own_pids_cgroups", lambda: [])
    assert cgroups.default_pids_max() == 4096  # two attempts can no longer take every pid of the host
    assert cgroups.default_pids_max(lanes=16) == 2048
    pid_max.write_text("4194304\n")
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "pids.max").write_text("10000\n")
    monkeypatch.setattr(cgroups, "_own_pids_cgroups", lambda: [parent])
    assert cgroups.default_pids_max() == 1250
    (parent / "pids.max").write_text("max\n")
    assert cgroups.default_pids_max() == 4194304 // 8
    pid_max.write_text("2048\n")
    assert cgroups.default_pids_max() == cgroups.PIDS_FLOOR


def test_on_this_host_the_default_is_below_half_its_pid_max():
    host = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert cgroups.PIDS_FLOOR <= cgroups.default_pids_max() <= max(host // 8, cgroups.PIDS_FLOOR)


# 3. Nothing that names other jobs.

def attempt(tmp_path: Path, job_id: str = "0123456789abcdef0123") -> tuple[Settings, sandbox.Attempt]:
    data = tmp_path / "data"
    run_dir, job_dir = data / "runs" / job_id / "attempt-1", data / "storage" / "jobs" / job_id
    for folder in (run_dir, job_dir / "checkpoints", job_dir / "artifacts", data / "scripts"):
        folder.mkdir(parents=True, exist_ok=True)
    return Settings(data_dir=data), sandbox.Attempt(job_id=job_id, run_dir=run_dir, job_dir=job_dir,
                                                    python=sys.executable, data_dir=data, scripts_dir=data / "scripts")


def test_a_cgroup_is_named_by_no_job_and_its_horse_pid_stays_last():
    names = {cgroups.new_name() for _ in range(3)}
    assert len(names) == 3 and all(n.rpartition("-")[2] == str(os.getpid()) for n in names)


@pytest.mark.skipif(sandbox.detect(Settings()).bwrap is None, reason="no sandbox on this machine")
def test_a_job_sees_sys_but_no_cgroup_tree_and_exactly_its_own_variables(tmp_path):
    settings, a = attempt(tmp_path)
    support = sandbox.detect(settings)
    box = sandbox.Box(support, settings, a, memory_bytes=2**30)
    try:
        if box.cgroup is not None:
            assert a.job_id not in box.cgroup.name and all(a.job_id not in str(d) for d in box.cgroup.dirs)
        job_env = {"PATH": "/usr/bin:/bin", "SPACED": "a b", "EQUALS": "x=y", "EMPTY": ""}
        probe = "ls -A /sys/fs/cgroup | wc -l; ls /sys/class | wc -l; ls /sys/devices/system/cpu | grep -c cpu; env"
        argv, env = box.wrap(["/bin/sh", "-c", probe], dict(job_env))
        assert env == sandbox.LAUNCH_ENV  # bwrap and setpriv, root, start on this alone (and the run tag, if any)
        assert "--setenv" not in argv and "a b" not in argv  # in no command line: read from a descriptor
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, preexec_fn=box.preexec,
                              pass_fds=box.pass_fds)
    finally:
        box.close()
    assert done.returncode == 0, done.stderr
    cgroup_entries, classes, cpus, *seen = done.stdout.splitlines()
    assert int(cgroup_entries) == 0 and int(classes) > 0 and int(cpus) > 0
    seen_env = dict(line.split("=", 1) for line in seen if "=" in line)
    seen_env.pop("PWD", None)  # the shell's own
    assert seen_env == {**job_env, "HOME": str(a.run_dir / "home"), "GLOO_SOCKET_IFNAME": "lo",
                        "NCCL_SOCKET_IFNAME": "lo"}


@pytest.mark.parametrize("name", ["GCONV_PATH", "GLIBC_TUNABLES", "LOCPATH", "NLSPATH", "HOSTALIASES"])
def test_a_variable_that_makes_glibc_load_or_read_by_path_is_refused_like_ld_star(client, name):
    response = client.post("/v1/jobs", json=mlp_spec(env={name: "/tmp/x"}))
    assert response.status_code == 422 and repr(name) in response.text


def test_data_path_is_no_oracle_for_the_services_own_files(client, settings):
    data = settings.data_dir
    (data / "corpus.txt").write_text("hello world " * 50)
    job = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    run = data / "runs" / job / "attempt-1"
    run.mkdir(parents=True)
    (run / "spec.json").write_text("{}")
    (settings.resolved_storage_dir / "jobs" / job / "artifacts").mkdir(parents=True)
    (settings.resolved_storage_dir / "jobs" / job / "artifacts" / "model.pt").write_text("w")
    (data / "envs").mkdir()
    (data / "envs" / "x").write_text("")

    def answer(path: str):
        r = client.post("/v1/jobs:validate", json=mlp_spec(model={"type": "gpt", "seq_len": 16},
                                                            data={"type": "text", "path": path}))
        return r.status_code, r.json().get("detail", "").replace(repr(path), "P"), r.json().get("field")

    missing = answer("no-such-file.txt")
    assert missing[0] == 422 and missing[2] == "data.path"
    assert answer("corpus.txt")[0] == 200
    for service_file in (f"runs/{job}/attempt-1/spec.json", f"storage/jobs/{job}/artifacts/model.pt", "trainjobs.db",
                         "envs/x", f"runs/{job}", f"corpus.txt/../runs/{job}/attempt-1/spec.json",
                         f"runs/{job}/nothing-here", "storage/jobs/0000000000000000dead/artifacts/model.pt"):
        assert answer(service_file) == missing, service_file


# 3e. The data dir, the SQLite file and the secrets: the service's uid alone.

def test_the_data_dir_the_sqlite_file_and_the_secrets_are_the_services_alone(tmp_path, redis):
    data = tmp_path / "fresh" / "data"
    settings = Settings(data_dir=data, redis_url="redis://127.0.0.1:6379/12", queue_prefix="tj-hb")
    make_private_dir(data)
    from service import migrate
    migrate.upgrade(settings.resolved_database_url)
    with TestClient(create_app(settings)):
        pass
    engine = make_engine(settings.resolved_database_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS probe (x)"))
        conn.execute(text("INSERT INTO probe VALUES (1)"))
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in data.glob("trainjobs.db*")}
    engine.dispose()

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(data) == 0o700 and modes["trainjobs.db"] == 0o600, modes
    assert all(m == 0o600 for m in modes.values()), modes  # -wal and -shm take the database's mode
    assert mode(settings.resolved_secrets_dir) == 0o700 and mode(settings.admin_token_file) == 0o600
