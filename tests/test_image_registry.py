"""spec.image from a private registry (issue 44): the owner's login (or the team's), lent for the pull alone and
never seen by the job; through a database worker's stack and through a joined worker's worker protocol."""

import io
import os
import re
import time
from pathlib import Path

import pytest

from service.settings import Settings
from tests.helpers import live_stack, wait_for, wait_terminal
from tests.image_build import entry, needs_sandbox, needs_tools, serving_registry
from worker import images

PEEK = """import os
hits = [k for k, v in os.environ.items() if "{marker}" in v]
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    for name in files:
        path = os.path.join(top, name)
        if os.path.realpath(path) == os.path.realpath(__file__) or os.path.islink(path):
            continue
        try:
            with open(path, "rb") as f:
                if b"{marker}" in f.read(64 << 20):
                    hits.append(path)
        except OSError:
            pass
print("login seen:", hits)
print("secrets dir seen:", os.path.exists("{secrets}"))
"""


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory):
    """A registry that asks for a login (robot, a password that starts "tjpw-"): (host:port, log, password)."""
    from tests import image_build

    python_layout, _ = image_build.build()
    password = f"tjpw-{os.urandom(8).hex()}"
    with serving_registry(tmp_path_factory.mktemp("private-registry"), {"private/py:1": f"{python_layout}:image"},
                          login=("robot", password)) as (where, log):
        yield where, log, password


def cli_login(stack, capsys, monkeypatch, headers: dict, *argv: str, password: str) -> int:
    """`trainjobs registry login ... --password-stdin` in this process, as the user of `headers`."""
    from service.cli.main import build_parser
    from trainjobs.client import Client

    monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
    parsed = build_parser().parse_args(["registry", "login", *argv, "--password-stdin"])
    with Client(stack.api_url, token=headers["Authorization"].removeprefix("Bearer ")) as client:
        code = parsed.remote(parsed, client)
    capsys.readouterr()
    return code


def user(api, name: str) -> dict:
    made = api.post("/v1/tokens", json={"name": name, "can_run_entrypoints": True}).json()
    return {"Authorization": f"Bearer {made['token']}"}


def reasons_while(api, job_id: str) -> list[str]:
    """Every pending reason the job showed until it ended (read every 50 ms), in order, each once."""
    seen: list[str] = []
    while (job := api.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
        if job.get("pending_reason") and job["pending_reason"] not in seen:
            seen.append(job["pending_reason"])
        time.sleep(0.05)
    return seen


@needs_tools
@needs_sandbox
def test_a_private_image_is_pulled_with_its_owners_login_which_the_job_never_sees(
        private_registry, postgres_url, tmp_path_factory, capsys, monkeypatch):
    where, log, password = private_registry
    reference = f"{where}/private/py:1"
    scripts = tmp_path_factory.mktemp("scripts")
    data = tmp_path_factory.mktemp("private-data")
    (scripts / "peek.py").write_text(PEEK.format(marker="tjpw-", secrets=f"{data}-secrets"))
    spec = entry(reference, "peek.py") | {"max_retries": 0}
    with live_stack(postgres_url, data, name="private", allow_entrypoints=True, scripts_dir=scripts,
                    image_insecure_registries=where) as stack, stack.client(timeout=10) as api:
        wait_for(lambda: api.get("/v1/workers").json()["items"], 30, what="the worker")
        alice, bob = user(api, "alice"), user(api, "bob")

        def run(headers: dict) -> tuple[dict, list[str]]:
            job_id = api.post("/v1/jobs", json=spec, headers=headers).json()["id"]
            reasons = reasons_while(api, job_id)
            return wait_terminal(api, job_id), reasons

        anonymous, _ = run(alice)
        assert anonymous["status"] == "failed" and anonymous["error"]["type"] == "image_unavailable"
        assert f"the registry {where} asks for a login, and none is stored for alice" in anonymous["error"]["message"]
        assert f"trainjobs registry login {where}" in anonymous["error"]["message"]

        assert cli_login(stack, capsys, monkeypatch, bob, where, "--username", "robot", password=password) == 0
        not_bobs, _ = run(alice)  # bob's login is bob's jobs'
        assert not_bobs["status"] == "failed" and "none is stored for alice" in not_bobs["error"]["message"]

        assert cli_login(stack, capsys, monkeypatch, alice, where, "--username", "robot", password="wrong") == 0
        wrong, _ = run(alice)
        assert wrong["status"] == "failed" and wrong["error"]["type"] == "image_unavailable"
        assert "refused the login of user alice (username robot)" in wrong["error"]["message"]

        assert cli_login(stack, capsys, monkeypatch, alice, where, "--username", "robot", password=password) == 0
        started = time.monotonic()
        job_id = api.post("/v1/jobs", json=spec, headers=alice).json()["id"]
        reasons = reasons_while(api, job_id)
        done, took_s = wait_terminal(api, job_id), time.monotonic() - started
        logs = api.get(f"/v1/jobs/{job_id}/logs").text
        assert done["status"] == "succeeded", (done["error"], logs[-3000:])
        assert "login seen: []" in logs and "secrets dir seen: False" in logs  # not in its env, not in its files
        assert password not in logs
        pulling = [r for r in reasons if r.startswith(f"pulling image {reference}: ")]
        assert pulling and all(re.fullmatch(r".*: [0-9.]+ MB of [0-9.]+ MB", r) for r in pulling), reasons
        assert f"unpacking image {reference}" in " ".join(reasons)
        shown = api.get(f"/v1/jobs/{job_id}/image").json()
        [ran] = shown["resolved"]
        assert ran["digest"].startswith("sha256:") and ran["pulled_s"] > 0 and shown["image"] == reference
        assert not any((Path(f"{data}-secrets") / "image-auth").iterdir())  # the pull's authfile is gone
        print(f"private image job: {took_s:.1f}s, pulled in {ran['pulled_s']:.1f}s; reasons shown: {reasons}")


@needs_tools
def test_a_joined_worker_pulls_a_private_image_with_the_login_the_api_lends(private_registry, postgres_url,
                                                                           tmp_path):
    """The same pull through the worker protocol over HTTP (a machine with its own credential, no database):
    the API decrypts the owner's login and lends it to the runner of the attempt; the pull's phase and digest go
    back the same way."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.jobs import lifecycle
    from tests.test_worker_join import join, join_token
    from worker.control import ApiControl
    from worker.image_pull import ForJob

    where, _, password = private_registry
    reference = f"{where}/private/py:1"
    with live_stack(postgres_url, tmp_path / "api", name="joined-pull", workers=0) as stack, \
            stack.client(timeout=10) as api:
        credential = join(api, join_token(api), "gpu-9").json()["credential"]
        alice = user(api, "alice")
        api.put(f"/v1/registry-credentials/{where}", json={"username": "robot", "password": password}, headers=alice)
        job_id = api.post("/v1/jobs", json=entry(reference) | {"max_retries": 0}, headers=alice).json()["id"]
        engine = create_engine(postgres_url)
        with Session(engine) as db:
            attempt, _ = lifecycle.claim(db, job_id=job_id, worker="gpu-9-1", lease_s=60)
            db.commit()
        engine.dispose()
        settings = Settings(data_dir=tmp_path / "worker", image_insecure_registries=where)
        pull = ForJob(ApiControl(stack.api_url, credential), settings, job_id=job_id, attempt=attempt)
        image = images.ImageCache(settings).get(reference, pull)
        try:
            assert (image.rootfs / "image-marker").read_text() == "only in the image\n"
            assert pull.login["whose"] == "user alice" and not any((settings.resolved_secrets_dir / "image-auth")
                                                                   .iterdir())
            [ran] = api.get(f"/v1/jobs/{job_id}/image", headers=alice).json()["resolved"]
            assert ran["digest"] == image.digest and ran["pulled_s"] > 0
            assert api.get(f"/v1/jobs/{job_id}").json()["pending_reason"].startswith(f"unpacking image {reference}")
        finally:
            image.release()
