"""The worker's secrets are cut out of shipped logs and kept out of the ranks' environment."""

from worker.redact import MASK, Redactor, rank_env, secret_values

ENV = {"AWS_SECRET_ACCESS_KEY": "abcd1234efgh", "TRAINJOBS_TOKEN": "tj_topsecretvalue", "HOME": "/root",
       "TRAINJOBS_DATABASE_URL": "postgresql://svc:p%40ssw0rd!@db:5432/jobs", "MY_AUTH": "no", "PATH": "/bin"}


def test_secret_values_come_from_secret_names_and_url_passwords():
    found = secret_values(ENV)
    assert {"abcd1234efgh", "tj_topsecretvalue", "p%40ssw0rd!", "p@ssw0rd!"} <= set(found)
    assert "/root" not in found and "no" not in found  # ordinary or too short to mask safely


def test_the_redactor_masks_every_occurrence():
    redact = Redactor(ENV)
    line = "connecting with p@ssw0rd! and key=abcd1234efgh; again abcd1234efgh\n"
    assert redact(line) == f"connecting with {MASK} and key={MASK}; again {MASK}\n"
    assert Redactor({"HOME": "/root"})("nothing to hide") == "nothing to hide"


def test_ranks_get_no_service_connection_strings_or_token():
    env = rank_env(ENV)
    assert "TRAINJOBS_DATABASE_URL" not in env and "TRAINJOBS_TOKEN" not in env and env["HOME"] == "/root"
