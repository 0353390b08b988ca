"""Registry logins (issue 44): a user's or a team's, set and listed through the API (never showing the password),
sealed at rest, and lent by the worker protocol's `image-login` only to the worker running a job of that owner,
for that job's image's registry. The pulls themselves, against a registry that asks for a login, are in
tests/test_images.py."""

import os
import stat

import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.images import seal
from service.images.models import RegistryCredential
from service.jobs import lifecycle
from service.jobs.models import Job
from tests.conftest import mlp_spec
from tests.test_worker_join import as_worker, join, join_token
from worker.control import DatabaseControl, Refused

REGISTRY = "registry.example.com:5000"
PASSWORD = "s3cret-Pass/word+1"


def token(client, user: str, *, team: str | None = None, role: str = "user") -> dict:
    made = client.post("/v1/tokens", json={"name": user, "role": role, **({"team": team} if team else {})})
    assert made.status_code == 201, made.text
    return {"Authorization": f"Bearer {made.json()['token']}"}


def put(client, headers: dict, registry: str = REGISTRY, **body):
    return client.put(f"/v1/registry-credentials/{registry}", headers=headers,
                      json={"username": "robot", "password": PASSWORD, **body})


def test_a_user_sets_lists_and_deletes_a_login_and_the_password_never_comes_back(client):
    alice = token(client, "alice")
    first = put(client, alice)
    assert first.status_code == 200, first.text
    assert first.json() | {"created_at": None, "updated_at": None} == {
        "registry": REGISTRY, "scope": "user", "owner": "alice", "username": "robot", "set_by": "alice",
        "created_at": None, "updated_at": None}
    assert put(client, alice, username="robot2", password="another").status_code == 200  # replaced, not added
    listed = client.get("/v1/registry-credentials", headers=alice)
    assert [(i["registry"], i["username"]) for i in listed.json()["items"]] == [(REGISTRY, "robot2")]
    for answer in (first, listed, client.get("/v1/registry-credentials")):
        assert PASSWORD not in answer.text and "another" not in answer.text and "sealed" not in answer.text
    assert client.get("/v1/registry-credentials", headers=token(client, "bob")).json()["items"] == []
    gone = client.delete(f"/v1/registry-credentials/{REGISTRY}", headers=alice)
    assert gone.status_code == 200 and gone.json()["username"] == "robot2"
    again = client.delete(f"/v1/registry-credentials/{REGISTRY}", headers=alice)
    assert again.status_code == 404 and again.json()["field"] == "registry"


@pytest.mark.parametrize(("registry", "body", "field"), [
    ("not_a_host!", {}, "registry"),
    (REGISTRY, {"username": "a:b"}, "username"),
    (REGISTRY, {"username": ""}, "username"),
    (REGISTRY, {"password": ""}, "password"),
    (REGISTRY, {"password": "line\nbreak"}, "password"),
    (REGISTRY, {"team": "no spaces"}, "team"),
    (REGISTRY, {"token": "x"}, "token"),
])
def test_bad_input_is_a_422_naming_the_field(client, registry, body, field):
    answer = put(client, {}, registry, **body)
    assert answer.status_code == 422, answer.text
    assert field in answer.text


def test_only_an_admin_sets_a_teams_login_and_its_members_see_that_it_exists(client):
    carol = token(client, "carol", team="vision")
    outsider = token(client, "dave", team="nlp")
    refused = put(client, carol, team="vision")
    assert refused.status_code == 403 and refused.json()["field"] == "team"
    unknown = put(client, {}, team="nobody-here")
    assert unknown.status_code == 422 and unknown.json()["field"] == "team"
    assert put(client, {}, team="vision").json()["scope"] == "team"
    assert [i["owner"] for i in client.get("/v1/registry-credentials", headers=carol).json()["items"]] == ["vision"]
    assert client.get("/v1/registry-credentials", headers=outsider).json()["items"] == []
    assert client.delete(f"/v1/registry-credentials/{REGISTRY}?team=vision", headers=carol).status_code == 403
    assert client.delete(f"/v1/registry-credentials/{REGISTRY}?team=vision").status_code == 200


def test_the_password_is_sealed_at_rest_under_a_key_in_the_secrets_dir(client, settings):
    put(client, token(client, "alice"))
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        row = db.scalars(select(RegistryCredential)).one()
        assert PASSWORD.encode() not in row.sealed
        moved = RegistryCredential(scope="user", owner="mallory", host=row.host, username=row.username,
                                   sealed=row.sealed, set_by="mallory", created_at=row.created_at,
                                   updated_at=row.updated_at)
    engine.dispose()
    key = seal.key_path(settings)
    assert key.parent == settings.resolved_secrets_dir and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    with pytest.raises(seal.SealBroken):  # a sealed password copied onto another's row does not open
        seal.unseal(settings, moved.sealed, bound_to=f"user:mallory:{row.host}:{row.username}")


def claimed_image_job(client, settings, headers: dict, image: str, worker: str = "gpu-7-5") -> tuple[str, int]:
    job_id = client.post("/v1/jobs", json=mlp_spec(image=image), headers=headers).json()["id"]
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        attempt, _ = lifecycle.claim(db, job_id=job_id, worker=worker, lease_s=30)
        db.commit()
    engine.dispose()
    return job_id, attempt


def test_image_login_lends_the_owners_login_else_the_teams_and_never_another_users(client, settings):
    alice, bob = token(client, "alice", team="vision"), token(client, "bob", team="vision")
    put(client, bob, username="bobs-robot")  # bob's own: never alice's jobs'
    put(client, {}, team="vision", username="team-robot")
    put(client, alice, "other.example.com", username="wrong-registry")
    job_id, attempt = claimed_image_job(client, settings, alice, f"{REGISTRY}/team/train:1")
    control = DatabaseControl(sessionmaker(create_engine(settings.resolved_database_url)), settings)
    ref = {"job_id": job_id, "attempt": attempt}
    lent = control.call("image-login", ref)
    assert lent == {"registry": REGISTRY, "owner": "alice", "username": "team-robot", "password": PASSWORD,
                    "whose": "team vision"}
    put(client, alice, username="alices-robot")
    assert control.call("image-login", ref)["username"] == "alices-robot"  # her own first
    client.delete(f"/v1/registry-credentials/{REGISTRY}", headers=alice)
    client.delete(f"/v1/registry-credentials/{REGISTRY}?team=vision")
    assert control.call("image-login", ref) | {"owner": None} == {
        "registry": REGISTRY, "owner": None, "username": None, "password": None, "whose": None}
    with pytest.raises(Refused) as missing:
        control.call("image-login", {**ref, "attempt": attempt + 1})
    assert missing.value.status == 404 and "attempt" in missing.value.detail
    put(client, alice, username="alices-robot")
    with control.sessions() as db:  # the job ended (failed, cancelled): its attempt is lent nothing more
        db.execute(update(Job).where(Job.id == job_id).values(status="failed"))
        db.commit()
    with pytest.raises(Refused) as ended:
        control.call("image-login", ref)
    assert ended.value.status == 409 and "no longer holds it" in ended.value.detail


def test_image_login_over_http_only_for_the_runner_that_runs_the_attempt(client, settings):
    mine = join(client, join_token(client), "gpu-7").json()["credential"]
    other = join(client, join_token(client), "gpu-8").json()["credential"]
    alice = token(client, "alice")
    put(client, alice)
    job_id, attempt = claimed_image_job(client, settings, alice, f"{REGISTRY}/team/train:1")
    body = {"job_id": job_id, "attempt": attempt}
    lent = client.post("/v1/worker/image-login", json=body, headers=as_worker(mine))
    assert lent.status_code == 200 and lent.json()["password"] == PASSWORD
    refused = client.post("/v1/worker/image-login", json=body, headers=as_worker(other))
    assert refused.status_code == 403 and PASSWORD not in refused.text
    assert client.post("/v1/worker/image-login", json=body, headers=alice).status_code == 401  # a user's token
    bad = client.post("/v1/worker/image-login", json={**body, "attempt": 0}, headers=as_worker(mine))
    assert bad.status_code == 422 and "attempt" in bad.text


def test_the_digest_a_node_ran_is_recorded_once_and_shown_to_the_jobs_owner(client, settings):
    mine = join(client, join_token(client), "gpu-7").json()["credential"]
    job_id, attempt = claimed_image_job(client, settings, {}, f"{REGISTRY}/team/train:1")
    digest = "sha256:" + "ab" * 32
    body = {"job_id": job_id, "attempt": attempt, "digest": digest, "pulled_s": 2.5}
    for _ in range(2):  # a replay adds nothing
        assert client.post("/v1/worker/image-pulled", json=body, headers=as_worker(mine)).status_code == 204
    shown = client.get(f"/v1/jobs/{job_id}/image").json()
    assert shown["image"] == f"{REGISTRY}/team/train:1"
    assert [r | {"time": None} for r in shown["resolved"]] == [
        {"attempt": attempt, "node_rank": 0, "digest": digest, "pulled_s": 2.5, "time": None}]
    assert client.get(f"/v1/jobs/{job_id}/image", headers=token(client, "eve")).status_code == 404  # not hers
    bad = client.post("/v1/worker/image-pulled", json={**body, "digest": "sha256:xyz"}, headers=as_worker(mine))
    assert bad.status_code == 422 and "digest" in bad.text


def test_the_cli_logs_in_from_stdin_lists_without_the_password_and_logs_out(client, capsys, monkeypatch):
    """`trainjobs registry login|list|logout` in this process, on the app (the parser, the SDK, the printing)."""
    import io

    from service.cli.main import build_parser
    from trainjobs.client import Client

    sdk = Client("http://testserver", token="unused")
    sdk.http = client  # the TestClient: the app in this process, with the admin's token
    monkeypatch.setenv("COLUMNS", "160")

    def cli(*argv: str, stdin: str = "") -> tuple[int, str]:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        parsed = build_parser().parse_args(["registry", *argv])
        code = parsed.remote(parsed, sdk)
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    code, said = cli("login", REGISTRY, "--username", "robot", "--password-stdin", stdin=PASSWORD + "\n")
    assert code == 0 and f"login to {REGISTRY} as robot stored for user admin" in said
    code, listed = cli("list")
    assert code == 0 and REGISTRY in listed and "robot" in listed and PASSWORD not in listed
    code, said = cli("logout", REGISTRY, "--json")
    assert code == 0 and '"username": "robot"' in said
    with pytest.raises(ValueError, match="--password-stdin"):  # no password on the command line, ever
        cli("login", REGISTRY, "--username", "robot")


def test_a_pulls_progress_is_the_jobs_pending_reason_written_at_most_every_two_seconds(client, settings):
    from worker.image_pull import SAY_EVERY_S, ForJob

    job_id, attempt = claimed_image_job(client, settings, {}, f"{REGISTRY}/team/train:1")
    control = DatabaseControl(sessionmaker(create_engine(settings.resolved_database_url)), settings)
    pull = ForJob(control, settings, job_id=job_id, attempt=attempt)
    reason = lambda: client.get(f"/v1/jobs/{job_id}").json()["pending_reason"]  # noqa: E731
    pull.say("pulling image x: 0 MB of 34 MB", now=True)
    pull.say("pulling image x: 12 MB of 34 MB")  # within SAY_EVERY_S of the last: not written
    assert reason() == "pulling image x: 0 MB of 34 MB" and SAY_EVERY_S == 2.0
    pull.say("unpacking image x (34 MB)", now=True)
    assert reason() == "unpacking image x (34 MB)"
