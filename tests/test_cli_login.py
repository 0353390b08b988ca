"""`trainjobs login`: one config file that the CLI and the SDK both read, from any folder; the order of what they
read (flag, environment, config file, the local admin token file, default); `logout`; a 401 that says where the
token came from or where none was found. The CLI runs as a user runs it: a subprocess, in a fresh shell."""

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from service.cli import main as cli
from tests.helpers import free_port, module_stack
from trainjobs.client import Client, connect

ROOT = Path(__file__).resolve().parent.parent
stack = module_stack("cli_login", workers=0)


@pytest.fixture(scope="module")
def alice(stack) -> str:
    """A user's token (not the admin's): what a new user is handed."""
    with stack.client() as api:
        return api.post("/v1/tokens", json={"name": "alice-laptop", "user": "alice"}).json()["token"]


@pytest.fixture
def home(tmp_path) -> Path:
    """A user's home with no config yet; the config file lands in its ~/.config/trainjobs/config.toml."""
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def shell(home: Path, **env: str) -> dict[str, str]:
    """A fresh shell's environment: none of the machine's TRAINJOBS_* settings, HOME at `home`."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith(("TRAINJOBS_", "XDG_CONFIG_HOME"))}
    return {**clean, "HOME": str(home), "PYTHONPATH": str(ROOT), **env}


def trainjobs(*argv: str, home: Path, cwd: Path, stdin: str | None = None, **env: str
              ) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "service.cli", *argv], cwd=cwd, env=shell(home, **env),
                          input=stdin, capture_output=True, text=True, timeout=60)


def config_of(home: Path) -> Path:
    return home / ".config" / "trainjobs" / "config.toml"


def test_login_saves_the_api_and_token_for_the_cli_and_the_sdk_in_any_folder(stack, alice, home, tmp_path,
                                                                            monkeypatch):
    done = trainjobs("login", stack.api_url, "--token", alice, home=home, cwd=tmp_path / "a")
    path = config_of(home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == f"logged in to {stack.api_url} as alice (role user); saved to {path} (readable by you " \
                          "only)\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and alice not in done.stdout + done.stderr
    assert tomllib.loads(path.read_text()) == {"api_url": stack.api_url, "token": alice}

    elsewhere = tmp_path / "b" / "no-data-dir-here"  # another folder, nothing of the service in it
    done = trainjobs("list", home=home, cwd=elsewhere)
    assert done.returncode == 0 and done.stdout.startswith("no jobs yet"), done.stdout + done.stderr
    done = trainjobs("whoami", home=home, cwd=elsewhere)
    assert done.stdout == f"alice (role user) at {stack.api_url}\n  API URL from {path}; token from {path}\n"

    monkeypatch.setenv("HOME", str(home))  # the SDK, in the same fresh shell
    for name in [n for n in os.environ if n.upper().startswith("TRAINJOBS_")] + ["XDG_CONFIG_HOME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(elsewhere)
    with Client() as sdk:
        assert sdk.me()["user"] == "alice" and sdk.list()["items"] == []
        assert (sdk.connection.api_url, sdk.connection.token_from) == (stack.api_url, str(path))


def test_login_reads_the_token_from_stdin_and_the_config_path_from_the_environment(stack, alice, home, tmp_path):
    elsewhere = tmp_path / "cfg" / "trainjobs.toml"
    done = trainjobs("login", "--url", stack.api_url + "/", "--token", "-", stdin=alice + "\n", home=home,
                     cwd=tmp_path, TRAINJOBS_CONFIG=str(elsewhere))
    assert done.returncode == 0 and f"saved to {elsewhere}" in done.stdout, done.stdout + done.stderr
    assert tomllib.loads(elsewhere.read_text())["api_url"] == stack.api_url  # no trailing slash kept
    assert not config_of(home).exists()
    xdg = tmp_path / "xdg"
    done = trainjobs("login", stack.api_url, "--token", alice, home=home, cwd=tmp_path, XDG_CONFIG_HOME=str(xdg))
    assert done.returncode == 0 and (xdg / "trainjobs" / "config.toml").is_file()


def test_login_with_a_token_the_api_refuses_or_an_api_not_there_saves_nothing(stack, home, tmp_path):
    done = trainjobs("login", stack.api_url, "--token", "tj_wrong", home=home, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stdout.startswith(f"error: the API at {stack.api_url} refused the token (HTTP 401") \
        and done.stdout.endswith("; nothing saved\n")
    dead = f"http://127.0.0.1:{free_port()}"
    done = trainjobs("login", dead, "--token", "tj_x", home=home, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout.startswith(f"error: cannot reach the API at {dead}")
    done = trainjobs("login", "localhost:8000", "--token", "tj_x", home=home, cwd=tmp_path)
    assert done.returncode == 2 and "is not an API URL" in done.stdout
    done = trainjobs("login", stack.api_url, home=home, cwd=tmp_path, stdin="")  # no terminal to ask on
    assert done.returncode == 2 and "give --token TOKEN" in done.stdout
    assert not config_of(home).exists()


def test_logout_removes_the_token_and_a_401_then_says_where_it_looked(stack, alice, home, tmp_path):
    assert trainjobs("login", stack.api_url, "--token", alice, home=home, cwd=tmp_path).returncode == 0
    done = trainjobs("logout", home=home, cwd=tmp_path)
    path = config_of(home)
    assert done.returncode == 0 and done.stdout.startswith(f"removed the token for {stack.api_url} from {path}")
    assert tomllib.loads(path.read_text()) == {"api_url": stack.api_url}
    done = trainjobs("list", home=home, cwd=tmp_path / "empty")
    admin_file = (tmp_path / "empty" / "trainjobs-data-secrets" / "admin.token")
    assert done.returncode == 2 and done.stdout.startswith("error: HTTP 401: ") and done.stdout.endswith(
        f" (no token for {stack.api_url}: looked at --token, TRAINJOBS_TOKEN, {path} and {admin_file}; run "
        f"`trainjobs login {stack.api_url} --token ...` (or set TRAINJOBS_TOKEN))\n")
    assert trainjobs("logout", home=home, cwd=tmp_path).stdout == f"no token saved in {path}: nothing to do\n"


def test_a_flag_wins_over_the_environment_which_wins_over_the_config_file(stack, alice, home, tmp_path):
    assert trainjobs("login", stack.api_url, "--token", alice, home=home, cwd=tmp_path).returncode == 0
    done = trainjobs("whoami", home=home, cwd=tmp_path, TRAINJOBS_TOKEN="tj_stale")
    assert done.returncode == 2 and "the token from TRAINJOBS_TOKEN was refused" in done.stdout
    done = trainjobs("whoami", "--token", stack.token, home=home, cwd=tmp_path, TRAINJOBS_TOKEN="tj_stale")
    assert done.returncode == 0 and done.stdout.startswith("admin (role admin)") and "token from --token" in done.stdout
    dead = f"http://127.0.0.1:{free_port()}"
    done = trainjobs("whoami", home=home, cwd=tmp_path, TRAINJOBS_API_URL=dead)
    assert done.returncode == 2 and f"cannot reach the API at {dead} (from TRAINJOBS_API_URL)" in done.stdout
    done = trainjobs("whoami", "--api-url", stack.api_url, home=home, cwd=tmp_path, TRAINJOBS_API_URL=dead)
    assert done.returncode == 0 and "API URL from --api-url; token from" in done.stdout


def test_the_order_of_what_the_cli_and_the_sdk_read(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('api_url = "http://saved:8000"\ntoken = "tj_saved"\n')
    admin = tmp_path / "data-secrets" / "admin.token"
    admin.parent.mkdir()
    admin.write_text("tj_admin\n")
    base = {"TRAINJOBS_CONFIG": str(config), "TRAINJOBS_DATA_DIR": str(tmp_path / "data")}

    def found(environ=None, **args):
        c = connect(environ={**base, **(environ or {})}, **args)
        return c.api_url, c.token

    assert found() == ("http://saved:8000", "tj_saved")
    assert found({"TRAINJOBS_TOKEN": "tj_env"}) == ("http://saved:8000", "tj_env")
    assert found({"TRAINJOBS_TOKEN": "tj_env"}, token="tj_flag") == ("http://saved:8000", "tj_flag")
    assert found({"TRAINJOBS_API_URL": "http://saved:8000/"}) == ("http://saved:8000/", "tj_saved")
    # NOTE: the saved token goes only to the API it was saved for: elsewhere, the local admin token file's
    assert found({"TRAINJOBS_API_URL": "http://other:1"}) == ("http://other:1", "tj_admin")
    assert found(api_url="http://other:1") == ("http://other:1", "tj_admin")
    config.unlink()
    assert found() == ("http://127.0.0.1:8000", "tj_admin")
    admin.unlink()
    assert found() == ("http://127.0.0.1:8000", None)
    config.write_text("not toml [")  # a broken file stops no caller who gave the URL and the token
    assert found(api_url="http://a:1", token="tj_a") == ("http://a:1", "tj_a")
    with pytest.raises(ValueError, match=f"{config}: not a valid config file"):
        found()


def test_a_broken_config_file_is_one_line_naming_it_and_login_writes_it_anew(stack, alice, home, tmp_path):
    path = config_of(home)
    path.parent.mkdir(parents=True)
    path.write_text('api_url = "http://x\n')
    done = trainjobs("list", home=home, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout.startswith(f"error: {path}: not a valid config file (")
    assert "line 1" in done.stdout and done.stdout.count("\n") == 1
    done = trainjobs("login", stack.api_url, "--token", alice, home=home, cwd=tmp_path)
    assert done.returncode == 0 and f"note: {path}: not a valid config file" in done.stderr
    assert trainjobs("whoami", home=home, cwd=tmp_path).stdout.startswith("alice")


def test_up_says_how_to_reach_it_from_another_shell(tmp_path):
    lines = cli.connect_lines("http://127.0.0.1:8001", tmp_path / "my data-secrets" / "admin.token")
    file = f"'{tmp_path}/my data-secrets/admin.token'"
    assert lines.splitlines() == [
        "to use it from any shell or folder, run once:",
        f"  trainjobs login http://127.0.0.1:8001 --token-file {file}",
        "or export:",
        "  export TRAINJOBS_API_URL=http://127.0.0.1:8001",
        f"  export TRAINJOBS_TOKEN=$(cat {file})",
    ]


def test_login_in_the_folder_of_a_local_stack_takes_its_admin_token(stack, home, tmp_path):
    """After `trainjobs up` in a folder, `trainjobs login URL` there needs no token typed: up's admin token file."""
    folder = tmp_path / "project"
    secrets = folder / "trainjobs-data-secrets"
    secrets.mkdir(parents=True)
    (secrets / "admin.token").write_text(stack.token + "\n")
    done = trainjobs("login", stack.api_url, home=home, cwd=folder, stdin="")
    assert done.returncode == 0 and f"using the token from {secrets / 'admin.token'}" in done.stderr
    assert done.stdout.startswith(f"logged in to {stack.api_url} as admin (role admin)")
    assert trainjobs("whoami", home=home, cwd=tmp_path).stdout.startswith("admin (role admin)")  # from elsewhere
