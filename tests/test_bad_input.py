"""Bad input: a 4xx that names the field, never a 500, and nothing written for a rejected job."""

import pytest

from tests.conftest import mlp_spec
from tests.helpers import count_jobs


def body_with(path: str, value) -> dict:
    spec = mlp_spec()
    node = spec
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return spec


BAD_FIELDS = [
    ("resources.nproc_per_node", 0),
    ("resources.nproc_per_node", "two"),
    ("resources.nproc_per_node", 10_000),
    ("resources.device", "tpu"),
    ("resources.nnodes", 0),
    ("resources.selector", {"gpu": 1}),
    ("data.batch_size", -1),
    ("data.num_samples", 10**12),
    ("data.type", "imagenet"),
    ("optimizer.lr", 0),
    ("optimizer.lr", -0.1),
    ("optimizer.type", "lion"),
    ("train.max_steps", 0),
    ("train.max_steps", 1.5),
    ("model.type", "resnet"),
    ("model.hidden", [0]),
    ("fsdp.mixed_precision", "fp8"),
    ("strategy", "horovod"),
    ("priority", "urgent"),
    ("timeout_s", -5),
    ("max_retries", 1000),
    ("name", ""),
    ("unknown_field", 1),
    ("train.learning_rate", 0.1),
]


@pytest.mark.parametrize("path,value", BAD_FIELDS, ids=[f"{p}={v!r}" for p, v in BAD_FIELDS])
def test_bad_field_is_422_naming_it_and_writes_nothing(client, settings, path, value):
    r = client.post("/v1/jobs", json=body_with(path, value))
    assert r.status_code == 422, r.text
    locs = [".".join(str(p) for p in e["loc"]) for e in r.json()["detail"]]
    top = path.split(".")[0]
    assert any(top in loc for loc in locs), locs
    assert count_jobs(settings.database_url) == 0


def test_auto_is_refused_for_an_entrypoint_job(client):
    spec = mlp_spec(strategy="auto", model=None, data=None, entrypoint={"module": "my_train"})
    detail = client.post("/v1/jobs", json=spec).json()["detail"]
    assert "needs a model to plan" in detail[0]["msg"]


def test_model_and_data_must_match(client):
    r = client.post("/v1/jobs", json=mlp_spec(data={"type": "synthetic_lm"}))
    assert r.status_code == 422 and "needs model.type 'gpt'" in r.text


def test_gpt_heads_must_divide_width(client):
    spec = mlp_spec(model={"type": "gpt", "d_model": 30, "n_head": 4}, data={"type": "synthetic_lm"})
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 422 and "divisible by n_head" in r.text


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "missing.txt"])
def test_text_data_outside_or_missing_in_data_dir_is_422(client, path):
    spec = mlp_spec(model={"type": "gpt"}, data={"type": "text", "path": path})
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "data.path"


def test_text_data_inside_data_dir_is_accepted(client, settings):
    (settings.data_dir / "corpus.txt").write_text("hello world " * 100)
    spec = mlp_spec(model={"type": "gpt", "seq_len": 16}, data={"type": "text", "path": "corpus.txt"})
    assert client.post("/v1/jobs", json=spec).status_code == 201


@pytest.mark.parametrize("body,content_type,status", [
    (b"{not json", "application/json", 400),  # not JSON at all: a 400 (service/api/invalid.py)
    (b"", "application/json", 422),
    (b"[1, 2, 3]", "application/json", 422),
    (b"name: x", "text/yaml", 422),
])
def test_body_that_is_not_a_json_spec_is_refused_and_writes_nothing(client, settings, body, content_type, status):
    r = client.post("/v1/jobs", content=body, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    assert r.json()["detail"]
    assert count_jobs(settings.database_url) == 0


@pytest.mark.parametrize("path", ["/v1/jobs/{id}", "/v1/jobs/{id}/metrics", "/v1/jobs/{id}/logs"])
@pytest.mark.parametrize("job_id", ["0123456789abcdef0123", "nope", "x" * 300])
def test_unknown_job_is_404(client, path, job_id):
    r = client.get(path.format(id=job_id))
    assert r.status_code == 404 and "not found" in r.json()["detail"]


def test_cancel_of_unknown_job_is_404(client):
    assert client.post("/v1/jobs/0123456789abcdef0123/cancel").status_code == 404


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": 10_000}, {"limit": "many"}, {"status": "done"},
                                    {"cursor": "bogus"}])
def test_bad_list_parameters_are_422(client, params):
    r = client.get("/v1/jobs", params=params)
    assert r.status_code == 422, r.text


def test_bad_metric_and_log_parameters_are_422(client):
    job = client.post("/v1/jobs", json=mlp_spec()).json()
    assert client.get(f"/v1/jobs/{job['id']}/logs", params={"offset": -1}).status_code == 422
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": "x"}).status_code == 422
