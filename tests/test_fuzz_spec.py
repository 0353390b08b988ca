"""Hypothesis on the spec parser: any JSON body gets a 201 or a 4xx naming what is wrong, never a 500,
and a refused body writes nothing."""

import copy

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, func, select

from service.api.app import create_app
from service.jobs.models import Job
from tests.conftest import admin_token, mlp_spec

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)
SPEC_KEYS = ["name", "strategy", "resources", "model", "data", "optimizer", "train", "priority", "max_retries",
             "timeout_s", "fsdp", "fault_injection", "entrypoint", "tags", "nnodes", "nproc_per_node", "type",
             "hidden", "lr", "max_steps", "batch_size", "device", "d_model", "n_head", "path", "module", "args"]


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))


@st.composite
def mutated_specs(draw):
    """A valid spec with one place replaced, one key added or one removed: the near misses a user makes."""
    spec = copy.deepcopy(mlp_spec(model=draw(st.sampled_from([{"type": "mlp", "hidden": [8]},
                                                             {"type": "gpt", "n_layer": 1, "d_model": 16}]))))
    where = draw(st.sampled_from(list(paths(spec))))
    parent = spec
    for key in where[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "add", "remove"]))
    if not where:
        return draw(json_values)
    if action == "replace":
        parent[where[-1]] = draw(json_values)
    elif action == "add" and isinstance(parent[where[-1]], dict):
        parent[where[-1]][draw(st.sampled_from(SPEC_KEYS) | st.text(max_size=8))] = draw(json_values)
    else:
        parent.pop(where[-1])
    return spec


@pytest.fixture
def api(settings, redis):
    loose = settings.model_copy(update={"submit_rate_per_min": 100_000, "quota_active_jobs": 100_000})
    with TestClient(create_app(loose), raise_server_exceptions=False) as c:
        c.headers["Authorization"] = f"Bearer {admin_token(loose)}"
        engine = create_engine(loose.resolved_database_url)
        def count() -> int:
            with engine.connect() as conn:
                return conn.scalar(select(func.count()).select_from(Job))

        c.count = count
        yield c
        engine.dispose()


def check(api, body) -> None:
    before = api.count()
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == 201 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code == 201:
        assert api.count() == before + 1
    else:
        assert api.count() == before, body  # a refused job leaves nothing behind
        detail = r.json()["detail"]
        assert detail and (isinstance(detail, str) or all(e.get("loc") for e in detail))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=json_values)
def test_any_json_value_is_a_201_or_a_4xx(api, body):
    check(api, body)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=mutated_specs())
def test_any_near_miss_of_a_valid_spec_is_a_201_or_a_4xx(api, body):
    check(api, body)
