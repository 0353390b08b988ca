"""What the CLI says, as a user reads it: a retried job's attempts named, the outcome first."""

import io

from rich.console import Console

from service.cli.follow import print_outcome, print_retried

FAULT = {"type": "RuntimeError", "message": "injected fault", "rank": 0,
         "traceback": "Traceback (most recent call last):\n  File \"train.py\", line 3\nRuntimeError: injected fault"}


def shown(print_, job: dict) -> str:
    out = io.StringIO()
    print_(job, Console(file=out, width=120))
    return out.getvalue()


def test_a_job_that_succeeded_on_its_second_attempt_says_so_first_and_labels_the_first_attempts_error():
    job = {"id": "j1", "status": "succeeded", "attempt": 2, "summary": {"final_loss": 0.25},
           "error": {**FAULT, "attempts": [{"attempt": 1, "type": "RuntimeError", "message": "injected fault"}]}}
    text = shown(print_outcome, job)
    lines = text.splitlines()
    assert lines[0] == "job j1 succeeded on attempt 2", text
    assert lines[-1] == "attempt 1 (retried): RuntimeError: injected fault", text
    assert "Traceback" not in text and "on rank 0" not in text  # the retried fault is no outcome


def test_a_job_that_failed_twice_shows_its_last_error_then_the_retried_one():
    job = {"id": "j1", "status": "failed", "attempt": 2, "summary": None,
           "error": {**FAULT, "message": "second fault",
                     "attempts": [{"attempt": 1, "type": "RuntimeError", "message": "injected fault"},
                                  {"attempt": 2, "type": "RuntimeError", "message": "second fault"}]}}
    lines = shown(print_outcome, job).splitlines()
    assert lines[0] == "job j1 failed on attempt 2"
    assert lines[1] == "RuntimeError on rank 0: second fault" and "RuntimeError: injected fault" in lines
    assert lines[-1] == "attempt 1 (retried): RuntimeError: injected fault"


def test_a_job_cancelled_during_its_retry_shows_the_first_attempts_error_as_retried_only():
    job = {"id": "j1", "status": "cancelled", "attempt": 2, "summary": None,
           "error": {**FAULT, "attempts": [{"attempt": 1, "type": "RuntimeError", "message": "injected fault"}]}}
    assert shown(print_outcome, job).splitlines() == ["job j1 cancelled on attempt 2",
                                                      "attempt 1 (retried): RuntimeError: injected fault"]


def test_a_job_that_failed_on_its_only_attempt_reads_as_before():
    job = {"id": "j1", "status": "failed", "attempt": 1, "summary": None,
           "error": {**FAULT, "attempts": [{"attempt": 1, "type": "RuntimeError", "message": "injected fault"}]}}
    text = shown(print_outcome, job)
    assert text.splitlines()[:2] == ["job j1 failed", "RuntimeError on rank 0: injected fault"]
    assert "retried" not in text and "RuntimeError: injected fault" in text  # the traceback's last line


def test_a_running_retry_names_the_attempt_before_it():
    job = {"id": "j1", "status": "running", "attempt": 2,
           "error": {**FAULT, "attempts": [{"attempt": 1, "type": "RuntimeError", "message": "injected fault"}]}}
    assert shown(print_retried, job) == "attempt 1 (retried): RuntimeError: injected fault\n"


def test_a_bad_value_for_a_union_field_is_one_sentence_about_that_field(client):
    """batch_size is an int >= 1 or "auto": pydantic's two branch errors (`...batch_size.constrained-int`,
    `...batch_size.literal['auto']`, under the data type's tag) are one error about `data.batch_size`."""
    from tests.conftest import mlp_spec

    spec = mlp_spec(data={"type": "synthetic_regression", "batch_size": -3})
    [error] = client.post("/v1/jobs", json=spec).json()["detail"]
    assert error["loc"] == ["body", "data", "batch_size"] and error["input"] == -3
    assert error["msg"] == "Input should be greater than or equal to 1, or 'auto'"
    [error] = client.post("/v1/jobs", json=mlp_spec(model={"type": "mlp", "hidden": [0]})).json()["detail"]
    assert error["loc"] == ["body", "model", "hidden", 0]  # a tagged union's tag (`mlp`) is no field either
    sweep = {"name": "s", "spec": spec, "parameters": {"optimizer.lr": {"values": [0.1]}}}
    [error] = client.post("/v1/sweeps", json=sweep).json()["detail"]
    assert error["loc"] == ["body", "spec", "data", "batch_size"], error


def test_the_readme_puts_trainjobs_on_the_path_before_a_bare_trainjobs_and_logs_in_as_up_says():
    """From a fresh clone: `.venv/bin/trainjobs up` first, then a bare `trainjobs` only once the venv is active;
    the CLI finds the token from another folder only once `trainjobs login` (the line `up` prints) saved it."""
    import re
    from pathlib import Path

    from service.cli.main import connect_lines

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    quick_start = readme.split("## A first job", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for block in quick_start.split("```")[1::2] for line in block.splitlines()]
    active = lines.index("source .venv/bin/activate         # or write .venv/bin/trainjobs for each trainjobs below")
    bare = [i for i, line in enumerate(lines) if re.match(r"trainjobs\s", line)]
    assert bare and min(bare) > active, lines
    assert all(".venv/bin/trainjobs up" in line for line in lines[:active] if "trainjobs up" in line)
    login = next(line for line in lines if line.startswith("trainjobs login "))
    said = connect_lines("http://127.0.0.1:8000", Path("trainjobs-data-secrets/admin.token")).splitlines()[1]
    assert login == said.strip(), (login, said)
    own = quick_start.split("Your own script", 1)[1]
    assert "`.venv/bin/trainjobs up --allow-entrypoints`" in own and "after the\n`trainjobs login` above" in own
