"""`trainjobs worker`: an RQ worker serving the high, normal and low queues in order; SIGTERM hands its job back."""

import logging
import os
import signal
import socket
from datetime import timedelta

from redis import Redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer
from rq.utils import now

import worker.agent  # noqa: F401 - preloaded: each forked work-horse starts with it imported
from service.queue import queue_names
from service.settings import get_settings
from worker.agent import request_preemption
from worker.inventory import start_publisher
from worker.launch import PREEMPT_SIGNAL


class PreemptingWorker(Worker):
    """RQ's worker, whose shutdown also hands the running job back to the queue (graceful preemption).

    RQ's warm shutdown (the first SIGTERM or SIGINT) stops taking jobs and waits for the current one;
    here it also sends PREEMPT_SIGNAL to the work-horse, whose supervisor has the ranks checkpoint and
    exit and records the job as queued again. A second signal is passed on too: the supervisor then stops
    the ranks at once (and still hands the job back). A third is RQ's cold shutdown: it SIGKILLs the
    horse; torchrun dies with it (PDEATHSIG) and takes the ranks down, the job's lease then expires.
    """

    _hard_stop_asked = False

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        # NOTE: in the horse right after fork, before the job function runs: no request is lost or fatal.
        signal.signal(PREEMPT_SIGNAL, request_preemption)

    def request_stop(self, signum, frame) -> None:
        self._tell_horse()
        super().request_stop(signum, frame)

    def request_force_stop(self, signum, frame) -> None:
        # RQ ignores a signal within 1 s of the first (a pool and a terminal may both send one): so do we.
        echo = self._shutdown_requested_date and now() - self._shutdown_requested_date < timedelta(seconds=1)
        if self.horse_pid and not echo and not self._hard_stop_asked:
            self._hard_stop_asked = True
            self.log.warning("Worker %s: stopping the running job now; a third signal kills the work-horse", self.name)
            self._tell_horse()
            return
        super().request_force_stop(signum, frame)

    def _tell_horse(self) -> None:
        if self.horse_pid:
            try:
                os.kill(self.horse_pid, PREEMPT_SIGNAL)
            except ProcessLookupError:  # it just ended
                pass


def main(burst: bool = False) -> None:
    settings = get_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redis = Redis.from_url(settings.redis_url)
    queues = [Queue(n, connection=redis, serializer=JSONSerializer) for n in queue_names(settings.queue_prefix)]
    name = os.environ.get("TRAINJOBS_WORKER_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    os.environ["TRAINJOBS_WORKER_NAME"] = name
    worker = PreemptingWorker(queues, connection=redis, serializer=JSONSerializer, name=name)
    stop_publishing = start_publisher(redis, prefix=settings.queue_prefix, name=name)  # for the memory plan
    try:
        worker.work(burst=burst, with_scheduler=False)
    finally:
        stop_publishing()


if __name__ == "__main__":
    main()
