"""Artifacts served from the object store (issue 31): streamed through the API with HTTP Range, or a redirect to a
presigned URL of the store when the operator turns that on. moto's S3 server on loopback is the store."""


import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.artifacts.stored import RangeNotSatisfiable, byte_range
from service.storage import artifact_key, open_store
from tests.conftest import admin_token, mlp_spec
from tests.s3 import moto_s3

BUCKET = "trainjobs-api"

BODY = bytes(range(256)) * 40  # 10,240 bytes


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3(BUCKET) as endpoint:
        yield endpoint


def served(settings, **overrides):
    """A client on an API whose artifacts are in the store, and a job with `weights/model final.pt` there."""
    settings = settings.model_copy(update={"storage_url": f"s3://{BUCKET}/api", **overrides})
    client = TestClient(create_app(settings))
    client.__enter__()
    client.headers["Authorization"] = f"Bearer {admin_token(settings)}"
    job_id = client.post("/v1/jobs", json=mlp_spec()).json()["id"]
    open_store(settings).put_bytes(artifact_key(job_id, "weights/model final.pt"), BODY)
    return client, f"/v1/jobs/{job_id}/artifacts/weights/model%20final.pt"


@pytest.mark.parametrize(("header", "span"), [
    (None, None), ("bytes=0-0", (0, 0)), ("bytes=10-19", (10, 19)), ("bytes=100-", (100, 10239)),
    ("bytes=-16", (10224, 10239)), ("bytes=10000-99999", (10000, 10239)), ("bytes=0-1,5-6", None),
    ("items=0-5", None), ("bytes=-99999", (0, 10239)),
])
def test_a_range_header_picks_the_bytes_asked(header, span):
    assert byte_range(header, len(BODY)) == span


@pytest.mark.parametrize("header", ["bytes=10240-", "bytes=20-10", "bytes=-0", "bytes=-"])
def test_a_range_of_no_byte_of_the_artifact_is_not_satisfiable(header):
    with pytest.raises(RangeNotSatisfiable):
        byte_range(header, len(BODY))


def test_an_artifact_streams_from_the_store_whole_or_by_range(s3_endpoint, settings, redis):
    client, url = served(settings)
    try:
        whole = client.get(url)
        assert whole.status_code == 200 and whole.content == BODY and whole.headers["accept-ranges"] == "bytes"
        assert whole.headers["content-disposition"] == "attachment; filename*=utf-8''model%20final.pt"
        part = client.get(url, headers={"Range": "bytes=1000-1999"})
        assert part.status_code == 206 and part.content == BODY[1000:2000]
        assert part.headers["content-range"] == "bytes 1000-1999/10240" and part.headers["content-length"] == "1000"
        tail = client.get(url, headers={"Range": "bytes=-10"})
        assert tail.status_code == 206 and tail.content == BODY[-10:]
        refused = client.get(url, headers={"Range": "bytes=20000-"})
        assert refused.status_code == 416 and refused.headers["content-range"] == "bytes */10240"
        assert refused.json()["field"] == "Range"
        assert client.get(url.replace("model%20final", "other")).status_code == 404
    finally:
        client.__exit__(None, None, None)


def test_an_operator_may_answer_downloads_with_a_presigned_url_of_the_store(s3_endpoint, settings, redis):
    client, url = served(settings, store_presigned_urls=True, store_presign_ttl_s=60)
    try:
        answer = client.get(url, follow_redirects=False)
        assert answer.status_code == 307 and answer.headers["location"].startswith(f"{s3_endpoint}/{BUCKET}/api/jobs/")
        assert "X-Amz-Expires=60" in answer.headers["location"]
        fetched = httpx.get(answer.headers["location"])  # no token: the signature is the right, for 60 s
        assert fetched.status_code == 200 and fetched.content == BODY
        assert "model%20final.pt" in fetched.headers["content-disposition"]
        tampered = answer.headers["location"].replace("model%20final.pt", "other.pt")
        assert httpx.get(tampered).status_code == 403
    finally:
        client.__exit__(None, None, None)
