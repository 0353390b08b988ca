"""A job named as a user names it: a unique id prefix (4 characters or more) or its exact name, in every command
that takes a job; an ambiguous one is an error listing the candidates. `cancel` takes several jobs, or a filter
that asks first."""

import json

import pytest

from service.cli import main as cli
from tests.conftest import mlp_spec
from trainjobs.client import Client


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    """No config file or environment of the machine's user leaks into a test."""
    monkeypatch.setenv("TRAINJOBS_CONFIG", str(tmp_path / "config.toml"))
    for name in ("TRAINJOBS_API_URL", "TRAINJOBS_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def run(client, capsys, *argv: str, code: int = 0) -> tuple[str, str]:
    """The command as `trainjobs ARGV` runs it (errors and exit code included), on the app's TestClient."""
    api = Client("http://testserver")
    api.http = client  # the TestClient is an httpx.Client on the app, with the admin token
    got = cli.main(list(argv), client=api)
    out = capsys.readouterr()
    assert got == code, out.out + out.err
    return out.out, out.err


def submit(client, name: str) -> str:
    return client.post("/v1/jobs", json=mlp_spec(name=name)).json()["id"]


def unique_prefix(job_id: str, others: list[str]) -> str:
    """The shortest prefix (4 or more) of job_id that no other id starts with."""
    return next(job_id[:n] for n in range(4, 21) if not any(o.startswith(job_id[:n]) for o in others))


def test_status_takes_a_unique_prefix_or_the_exact_name(client, capsys):
    ids = [submit(client, name) for name in ("alpha", "beta", "gamma")]
    prefix = unique_prefix(ids[1], [ids[0], ids[2]])
    out, _ = run(client, capsys, "status", prefix, "--json")
    assert json.loads(out)["id"] == ids[1]
    out, _ = run(client, capsys, "status", "gamma", "--json")
    assert json.loads(out)["id"] == ids[2]
    out, _ = run(client, capsys, "logs", "alpha", "--json")  # any command that takes a job
    assert json.loads(out)["job_id"] == ids[0]


def test_an_ambiguous_prefix_or_name_is_an_error_listing_the_candidates(client, capsys):
    ids = [submit(client, name) for name in ("twin", "twin", "solo")]
    shared = ids[0][:4]  # made within seconds: the time-ordered ids share their first digits
    assert all(i.startswith(shared) for i in ids)
    out, _ = run(client, capsys, "status", shared, code=2)
    assert f"'{shared}' matches 3 jobs" in out and all(i in out for i in ids) and "Traceback" not in out
    out, _ = run(client, capsys, "cancel", "twin", code=1)
    assert "'twin' matches 2 jobs" in out and ids[0] in out and ids[1] in out and ids[2] not in out
    assert {client.get(f"/v1/jobs/{i}").json()["status"] for i in ids} == {"queued"}  # nothing cancelled


def test_a_reference_that_names_no_job_says_how_to_name_one(client, capsys):
    job_id = submit(client, "only")
    out, _ = run(client, capsys, "status", "nope", code=2)
    assert "no job matches 'nope'" in out and "unique prefix" in out
    out, _ = run(client, capsys, "status", job_id[:3], code=2)
    assert "4 characters or more" in out
    out, _ = run(client, capsys, "status", "0" * 20, code=2)  # a whole id goes to the API as it is: its 404
    assert "HTTP 404" in out


def test_cancel_takes_several_jobs_and_says_what_happened_to_each(client, capsys):
    ids = [submit(client, f"job-{i}") for i in range(3)]
    client.post(f"/v1/jobs/{ids[2]}/cancel")
    out, _ = run(client, capsys, "cancel", ids[0], "job-1", ids[2], "f" * 20, code=1)
    lines = out.splitlines()
    assert lines[0] == f"{ids[0]}: cancelled"
    assert lines[1] == f"job-1 ({ids[1]}): cancelled"
    assert lines[2] == f"{ids[2]}: cancelled"  # already: a cancel is idempotent
    assert lines[3] == f"{'f' * 20}: no such job" and len(lines) == 4
    assert {client.get(f"/v1/jobs/{i}").json()["status"] for i in ids} == {"cancelled"}


def test_cancel_all_queued_asks_first_and_yes_cancels_each(client, capsys, monkeypatch):
    ids = [submit(client, f"queued-{i}") for i in range(3)]
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    # stdin is not a terminal: nothing is cancelled without --yes, and the jobs it would cancel are listed
    out, err = run(client, capsys, "cancel", "--all-queued", code=2)
    assert "without --yes" in err and ids[1] in err and ids[2] in err and ids[0] not in err
    assert client.get(f"/v1/jobs/{ids[1]}").json()["status"] == "queued"
    # at a terminal, the answer decides
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    run(client, capsys, "cancel", "--status", "queued", code=2)
    assert client.get(f"/v1/jobs/{ids[1]}").json()["status"] == "queued"
    out, _ = run(client, capsys, "cancel", "--all-queued", "--yes")
    assert sorted(out.splitlines()) == sorted(f"{i} (queued-{n}): cancelled" for n, i in enumerate(ids) if n)
    out, _ = run(client, capsys, "cancel", "--all-queued", "--yes")
    assert out == "no job matches: nothing cancelled\n"


def test_cancel_with_json_prints_the_job_for_one_and_a_list_for_several(client, capsys):
    ids = [submit(client, f"j{i}") for i in range(2)]
    out, _ = run(client, capsys, "cancel", ids[0], "--json")
    assert json.loads(out)["id"] == ids[0]
    out, err = run(client, capsys, "cancel", *ids, "--json")
    assert [j["id"] for j in json.loads(out)] == ids and err.count("cancelled") == 2


def test_cancel_needs_jobs_or_a_filter(client, capsys):
    out, _ = run(client, capsys, "cancel", code=2)
    assert "name the jobs to cancel" in out


def test_sweep_commands_take_a_unique_prefix_or_the_exact_name(client, capsys):
    from tests.test_sweeps import sweep_body

    made = [client.post("/v1/sweeps", json=sweep_body(name=name)).json()["id"] for name in ("lr-a", "lr-b")]
    prefix = unique_prefix(made[0], [made[1]])
    out, _ = run(client, capsys, "sweep-status", prefix, "--json")
    assert json.loads(out)["id"] == made[0]
    out, _ = run(client, capsys, "list", "--sweep", "lr-b", "--json")
    assert {job["sweep_id"] for job in json.loads(out)["items"]} == {made[1]}
    out, _ = run(client, capsys, "sweep-cancel", "lr-b")
    assert f"sweep {made[1]} (lr-b): cancelled" in out
    out, _ = run(client, capsys, "sweep-status", made[0][:4], code=2)  # both made within seconds: 4 digits shared
    assert f"'{made[0][:4]}' matches 2 sweeps" in out and made[1] in out
    out, _ = run(client, capsys, "sweep-cancel", "no-such-sweep", code=2)
    assert "no sweep matches 'no-such-sweep'" in out and "`trainjobs sweeps` shows them" in out
