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
from tests.conftest import POSTGRES_URL, QUEUE_PREFIX, REDIS_URL, _empty_tables, admin_token

# The schema is read when the module is collected, so the app exists then; its lifespan (the admin token,
# the sweeper) runs in the fixture below, on the migrated test database.
CONF = Settings(data_dir=Path(tempfile.mkdtemp(prefix="schemathesis-")), database_url=POSTGRES_URL,
                redis_url=REDIS_URL, queue_prefix=f"{QUEUE_PREFIX}st", reconcile_s=3600,
                submit_rate_per_min=100_000, quota_active_jobs=100_000)
APP = create_app(CONF)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module")
def token(postgres_url):
    _empty_tables(postgres_url)
    with TestClient(APP):
        yield admin_token(CONF)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_keeps_to_its_schema(case, token):
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"},
                           excluded_checks=[positive_data_acceptance])
