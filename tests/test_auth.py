"""Authentication: every /v1 route and /metrics need a live bearer token; tokens are shown once, kept hashed."""

import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.auth import tokens
from service.db import utcnow
from service.settings import Settings
from tests.conftest import mlp_spec

JOB_ID = "0123456789abcdef0123"


def v1_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every documented route under /v1, with the path's parameters filled in."""
    found = []
    for path, item in app.openapi()["paths"].items():
        if path.startswith("/v1"):
            concrete = (path.replace("{job_id}", JOB_ID).replace("{token_id}", "tok_x").replace("{name}", "m.pt")
                        .replace("{digest}", "sha256:" + "0" * 64))
            found += [(method.upper(), concrete) for method in item]
    return found


def make_token(settings, user: str, **fields) -> str:
    engine = create_engine(settings.resolved_database_url)
    with Session(engine) as db:
        _, secret = tokens.create(db, name=f"{user}-token", user=user, **fields)
    engine.dispose()
    return secret


def test_every_v1_route_needs_a_token(client):
    routes = v1_routes(client.app)
    assert len(routes) >= 12 and ("POST", "/v1/jobs") in routes and ("GET", f"/v1/jobs/{JOB_ID}/events") in routes
    for method, path in [*routes, ("GET", "/metrics")]:
        for headers in ({}, {"Authorization": "Bearer tj_not-a-token"}, {"Authorization": "Basic dXNlcjpwdw=="}):
            r = client.request(method, path, headers={"Authorization": "", **headers}, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert method == "HEAD" or r.json()["field"] == "Authorization"  # a HEAD answer has no body


def test_health_probes_stay_open(client):
    assert client.get("/healthz", headers={"Authorization": ""}).status_code == 200
    assert client.get("/readyz", headers={"Authorization": ""}).status_code == 200


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_a_revoked_or_expired_token_is_refused_everywhere(client, settings, how):
    # NOTE: a token expires by its expires_at, set when it is made (no route changes it): the principal it
    # was cached with carries it, so a token seen a moment ago is refused once it is past.
    expires_at = utcnow() + timedelta(seconds=1) if how == "expired" else None
    secret = make_token(settings, "bob", expires_at=expires_at)
    bob = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/jobs", headers=bob).status_code == 200
    if how == "revoked":
        engine = create_engine(settings.resolved_database_url)
        with Session(engine) as db:
            row = db.query(tokens.ApiToken).filter_by(user="bob").one()
        engine.dispose()
        assert client.delete(f"/v1/tokens/{row.id}", headers=bob).status_code == 200  # one's own
    else:
        time.sleep(max(0.0, (expires_at - utcnow()).total_seconds()) + 0.05)
    for method, path in v1_routes(client.app):
        r = client.request(method, path, headers=bob, json={})
        assert r.status_code == 401, (method, path)
        if path.startswith("/v1/worker/"):  # a worker's route: no user's token, live or not, is a worker's
            assert "tjj_" in r.json()["detail"] or "tjw_" in r.json()["detail"], (method, path)
            continue
        assert method == "HEAD" or "invalid, revoked or expired" in r.json()["detail"], (method, path)


def test_tokens_are_stored_only_as_hashes(client, settings):
    made = client.post("/v1/tokens", json={"name": "ci", "user": "carol"}).json()
    secret = made["token"]
    assert secret.startswith("tj_") and len(secret) >= 3 + 43  # 32 random bytes, urlsafe base64
    admin_secret = settings.admin_token_file.read_text().strip()
    engine = create_engine(settings.resolved_database_url)
    with engine.connect() as conn:
        dump = repr(conn.execute(text("SELECT * FROM api_tokens")).all()) + repr(
            conn.execute(text("SELECT * FROM users")).all())
    engine.dispose()
    assert secret not in dump and admin_secret not in dump
    assert tokens.hash_secret(secret) in dump
    listed = client.get("/v1/tokens").json()["data"]
    assert {t["id"] for t in listed} >= {made["id"]} and all("token" not in t for t in listed)


def test_admins_make_tokens_users_see_and_revoke_only_their_own(client, settings):
    dave = {"Authorization": f"Bearer {make_token(settings, 'dave')}"}
    erin = client.post("/v1/tokens", json={"name": "erin", "expires_in_s": 3600}).json()
    assert erin["user"] == "erin" and erin["role"] == "user" and erin["expires_at"] is not None
    r = client.post("/v1/tokens", json={"name": "mine", "role": "admin"}, headers=dave)
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    assert [t["user"] for t in client.get("/v1/tokens", headers=dave).json()["data"]] == ["dave"]
    assert client.delete(f"/v1/tokens/{erin['id']}", headers=dave).status_code == 404  # not dave's: no leak
    assert client.get("/v1/me", headers={"Authorization": f"Bearer {erin['token']}"}).json()["user"] == "erin"
    me = client.get("/v1/me", headers=dave).json()
    assert me == {"user": "dave", "role": "user", "token_id": me["token_id"], "can_run_entrypoints": False,
                  "multinode": False}
    used = [t for t in client.get("/v1/tokens").json()["data"] if t["user"] == "dave"]
    assert used[0]["last_used_at"] is not None


@pytest.mark.parametrize("body, field", [
    ({"name": "x", "role": "root"}, "role"), ({"name": ""}, "name"), ({"name": "x", "expires_in_s": 0},
                                                                          "expires_in_s"),
    ({"name": "x", "user": "a/b"}, "user"), ({"name": "x", "extra": 1}, "extra")])
def test_a_bad_token_request_is_422_naming_the_field(client, body, field):
    r = client.post("/v1/tokens", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field


def test_auth_off_serves_loopback_without_tokens_and_nothing_else(settings, redis):
    off = settings.model_copy(update={"auth": False})
    with TestClient(create_app(off), base_url="http://127.0.0.1") as local:
        r = local.post("/v1/jobs", json=mlp_spec())
        assert r.status_code == 201 and r.json()["owner"] == "admin"
    assert not settings.admin_token_file.exists()  # no token is made with auth off
    with TestClient(create_app(off), base_url="http://10.1.2.3") as remote:
        r = remote.get("/v1/jobs")
        assert r.status_code == 401 and "loopback" in r.json()["detail"]


def test_with_auth_off_the_cli_refuses_to_listen_beyond_loopback(settings):
    from service.settings import check_bind

    off = settings.model_copy(update={"auth": False})
    check_bind(off, "127.0.0.1")
    check_bind(off, "::1")
    with pytest.raises(SystemExit, match="loopback only"):
        check_bind(off, "0.0.0.0")
    check_bind(settings, "0.0.0.0")  # auth on: any address


def test_the_admin_token_lives_in_no_folder_a_job_is_handed(client, settings):
    """A job's ranks get the data dir, storage and scripts: the service's secrets are elsewhere, 0700/0600."""
    secret = settings.admin_token_file.read_text().strip()
    for folder in (settings.data_dir, settings.resolved_storage_dir, settings.resolved_scripts_dir):
        assert not settings.admin_token_file.is_relative_to(folder.resolve())
    assert settings.admin_token_file.stat().st_mode & 0o777 == 0o600
    assert settings.resolved_secrets_dir.stat().st_mode & 0o777 == 0o700
    leaked = [p for p in settings.data_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []


def test_a_token_file_an_older_version_left_in_the_data_dir_is_moved_out(settings, redis):
    settings.data_dir.mkdir(parents=True)
    (settings.data_dir / "admin.token").write_text("tj_old\n")
    with TestClient(create_app(settings)) as c:
        c.headers["Authorization"] = f"Bearer {settings.admin_token_file.read_text().strip()}"
        assert c.get("/v1/me").json()["role"] == "admin"
    assert not (settings.data_dir / "admin.token").exists()


@pytest.mark.parametrize("inside", ["data", "data/storage", "scripts"])
def test_a_secrets_dir_inside_a_folder_jobs_are_handed_is_refused(tmp_path, inside):
    with pytest.raises(ValueError, match="TRAINJOBS_SECRETS_DIR"):
        Settings(data_dir=tmp_path / "data", scripts_dir=tmp_path / "scripts", secrets_dir=tmp_path / inside / "s")
