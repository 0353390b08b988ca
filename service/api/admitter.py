"""The API process's submissions, admitted together: one thread takes every submission waiting and admits them
in one go (service/jobs/admission.py's admit_many), so 50 clients submitting at once cost a few round trips and
one commit a batch, not each their own, and no 40 threads taking turns at the GIL around them.

A submission is answered only once its batch committed and enqueued, as before: a 201 still means the job is
stored. A batch that fails as a whole (the database unreachable) answers each of its submissions with that error.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass

from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from service.jobs import admission
from service.jobs.bodies import RenderedJobs
from service.scheduling import service as scheduling
from service.settings import Settings

log = logging.getLogger(__name__)
MAX_BATCH = 64  # submissions a batch: its transaction stays short


@dataclass(frozen=True)
class Answer:
    job_id: str
    version: int
    body: bytes
    created: bool


class Admitter:
    """Submissions in, answers out: one thread, started with the first submission, stopped by close()."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], redis: Redis, bodies: RenderedJobs,
                 needs: MutableMapping[str, scheduling.Req]):
        self.settings, self.sessions, self.redis, self.bodies, self.needs = settings, sessions, redis, bodies, needs
        self.waiting: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    async def admit(self, submission: admission.Submission) -> Answer:
        """The submission's answer, once its batch is stored and enqueued; its refusal raised as it would be."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.start()
        self.waiting.put((submission, loop, answer))
        # A client gone mid-request cancels the future, not the submission: it is admitted all the same (as a
        # thread would have gone on), its answer dropped.
        return await answer

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="admitter", daemon=True)
                self.thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Admit what is waiting, then stop the thread."""
        with self.lock:
            thread, self.thread = self.thread, None
        if thread is not None:
            self.waiting.put(None)
            thread.join(timeout=timeout_s)

    def run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < MAX_BATCH and batch[-1] is not None:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            if stop:
                batch.pop()
            if batch:
                self.settle(batch, self.answers([submission for submission, _, _ in batch]))
            if stop:
                return

    def answers(self, asked: list[admission.Submission]) -> list[Answer | BaseException]:
        try:
            with self.sessions() as db:
                outcomes = admission.admit_many(asked, db=db, redis=self.redis, settings=self.settings,
                                                needs=self.needs)
                return [o if isinstance(o, Exception) else
                        Answer(o[0].id, o[0].version, self.bodies.render(o[0]), o[1]) for o in outcomes]
        except Exception as exc:  # noqa: BLE001 - the whole batch's (an outage): each submission's answer
            return [exc] * len(asked)

    @staticmethod
    def settle(batch: list, answers: list[Answer | BaseException]) -> None:
        for (_, loop, future), answer in zip(batch, answers, strict=True):
            try:
                loop.call_soon_threadsafe(_set, future, answer)
            except RuntimeError:  # its loop closed (a test's client gone): nobody is waiting
                pass


def _set(future: asyncio.Future, answer: Answer | BaseException) -> None:
    if future.done():
        return
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)
