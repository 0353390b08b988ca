"""`trainjobs worker`: an RQ worker serving the high, normal and low queues in that order."""

import logging
import os
import socket

from redis import Redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer

import worker.agent  # noqa: F401 - preloaded: each forked work-horse starts with it imported
from service.queue import queue_names
from service.settings import get_settings
from worker.inventory import start_publisher


def main(burst: bool = False) -> None:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redis = Redis.from_url(settings.redis_url)
    queues = [Queue(n, connection=redis, serializer=JSONSerializer) for n in queue_names(settings.queue_prefix)]
    name = os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    os.environ["TRAINJOBS_WORKER_NAME"] = name
    worker = Worker(queues, connection=redis, serializer=JSONSerializer, name=name)
    stop_publishing = start_publisher(redis, prefix=settings.queue_prefix, name=name)  # for the memory plan
    try:
        worker.work(burst=burst, with_scheduler=False)
    finally:
        stop_publishing()


if __name__ == "__main__":
    main()
