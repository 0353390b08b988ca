"""`trainjobs db upgrade [REV]` and `trainjobs db downgrade REV` on the embedded SQLite: the revision moves, an
unknown one is a clear error (exit 2), and a downgrade without a revision is refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def db(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINJOBS_DATA_DIR": str(tmp_path / "data")}
    env.pop("TRAINJOBS_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "service.cli", "db", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_db_downgrade_and_upgrade_move_the_revision_and_say_where_it_is(tmp_path):
    up = db(tmp_path, "upgrade", "--json")
    assert up.returncode == 0, up.stderr
    head = json.loads(up.stdout)["revision"]
    down = db(tmp_path, "downgrade", "-1", "--json")
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["revision"] not in (head, None)
    again = db(tmp_path, "upgrade", "--json")
    assert json.loads(again.stdout)["revision"] == head


def test_an_unknown_revision_or_none_for_a_downgrade_is_a_clear_error(tmp_path):
    assert db(tmp_path, "upgrade").returncode == 0
    unknown = db(tmp_path, "downgrade", "9999")
    assert unknown.returncode == 2 and "9999" in unknown.stdout and "Traceback" not in unknown.stderr
    missing = db(tmp_path, "downgrade")
    assert missing.returncode == 2 and "needs a revision" in missing.stdout
