"""`trainjobs token create|list|revoke`: the secret alone on stdout (scripts capture it), details on stderr."""

import json

import pytest

from service.cli import main as cli
from service.cli.tokens import parse_duration
from service.settings import Settings
from trainjobs.client import Client, find_token


def run(client, capsys, *argv: str) -> tuple[str, str]:
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app, with the admin token
    args = cli.build_parser().parse_args(list(argv))
    assert args.remote(args, api) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_token_create_prints_only_the_secret_on_stdout_and_it_works(client, capsys):
    out, err = run(client, capsys, "token", "create", "ci-bot", "--user", "frank", "--expires", "30d",
                   "--entrypoints")
    secret = out.strip()
    assert out == secret + "\n" and secret.startswith("tj_")
    assert "frank" in err and "shown only now" in err and secret not in err
    me = client.get("/v1/me", headers={"Authorization": f"Bearer {secret}"}).json()
    assert me["user"] == "frank" and me["role"] == "user" and me["can_run_entrypoints"] is True

    out, _ = run(client, capsys, "token", "list", "--json")
    listed = {t["name"]: t for t in json.loads(out)["data"]}
    assert listed["ci-bot"]["expires_at"] is not None and secret not in out
    _, err = run(client, capsys, "token", "revoke", listed["ci-bot"]["id"])
    assert "revoked" in err
    assert client.get("/v1/me", headers={"Authorization": f"Bearer {secret}"}).status_code == 401


def test_an_admin_token_from_the_cli(client, capsys):
    out, _ = run(client, capsys, "token", "create", "ops", "--admin")
    me = client.get("/v1/me", headers={"Authorization": f"Bearer {out.strip()}"}).json()
    assert me["role"] == "admin" and me["user"] == "ops"


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("3600", 3600),
                                           ("2w", 14 * 86400)])
def test_expiry_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0d", "soon", "-1h", "1y"])
def test_a_bad_expiry_is_refused_by_argparse(text, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["token", "create", "x", "--expires", text])
    assert "--expires" in capsys.readouterr().err


def test_the_cli_takes_trainjobs_token_else_the_admin_token_file(tmp_path):
    settings = Settings(data_dir=tmp_path / "data")
    assert find_token(settings) is None
    (tmp_path / "data-secrets").mkdir()
    (tmp_path / "data-secrets" / "admin.token").write_text("tj_from-file\n")
    assert find_token(settings) == "tj_from-file"
    assert find_token(Settings(data_dir=tmp_path / "data", token="tj_from-env")) == "tj_from-env"
