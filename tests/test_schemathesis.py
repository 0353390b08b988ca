"""Schemathesis against the app's own OpenAPI schema, in-process, with a token: no 5xx, nothing off-schema.

Every default check runs but positive_data_acceptance: a job spec has rules across fields (a model needs
matching data, or an entrypoint instead) that JSON Schema does not express, so a schema-valid body may
rightly get a 422. Every other check holds: no server error, every status and header documented, every
response body matching its schema, schema-violating input refused.
"""

import tempfile
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.api.app import create_app
from service.settings import Settings
from tests.conftest import QUEUE_PREFIX, REDIS_URL, _empty_tables, admin_token


def routes_document() -> dict:
    """The OpenAPI document, which the routes alone make: from an app built on nothing and never started."""
    with tempfile.TemporaryDirectory(prefix="schemathesis-doc-") as folder:
        return create_app(Settings(data_dir=Path(folder), database_url="sqlite://", redis_url=REDIS_URL)).openapi()


# The operations must be known when the module is collected, when a fresh machine's test database is still
# empty: schemathesis.pytest.from_fixture would wait for the fixture, but it fails on pytest 9 (no `_nodeid`).
schema = schemathesis.openapi.from_dict(routes_document())


@pytest.fixture(scope="module")
def conf(postgres_url, tmp_path_factory) -> Settings:
    return Settings(data_dir=tmp_path_factory.mktemp("schemathesis"), database_url=postgres_url, redis_url=REDIS_URL,
                    queue_prefix=f"{QUEUE_PREFIX}st", reconcile_s=3600, submit_rate_per_min=100_000,
                    quota_active_jobs=100_000)


@pytest.fixture(scope="module")
def app(conf):
    """The app the calls reach, built and started (the admin token, the sweeper) on the migrated test database."""
    _empty_tables(conf.database_url)
    app = create_app(conf)
    with TestClient(app):
        yield app


@pytest.fixture(scope="module")
def token(app, conf) -> str:
    return admin_token(conf)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_keeps_to_its_schema(case, app, token):
    case.call_and_validate(app=app, headers={"Authorization": f"Bearer {token}"},
                           excluded_checks=[positive_data_acceptance])
