"""Nothing a client sends is ever unpickled: the queue's payloads are JSON, and a pickle is refused."""

import json
import pickle
import zlib

import pytest
from rq.serializers import JSONSerializer

from service.jobs.queue import get_queue
from tests.conftest import QUEUE_PREFIX, mlp_spec


def test_queue_payloads_are_json_not_pickle(client, redis):
    job_id = client.post("/v1/jobs", json=mlp_spec(name="x")).json()["id"]
    raw = redis.hget(f"rq:job:{job_id}", "data")
    payload = zlib.decompress(raw)
    assert not payload.startswith(b"\x80")  # a pickle's protocol marker
    func, _instance, args, _kwargs = json.loads(payload)
    assert func.startswith("worker.") and args == [job_id]  # only our id crosses Redis, never the spec


def test_the_queues_serializer_refuses_a_pickle(redis):
    assert get_queue(redis, QUEUE_PREFIX, "normal").serializer is JSONSerializer
    with pytest.raises((ValueError, UnicodeDecodeError)):
        JSONSerializer.loads(pickle.dumps({"x": 1}))
