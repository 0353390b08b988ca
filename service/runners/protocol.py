"""The worker protocol's calls (issue 42, docs/architecture.md "The worker protocol"), one registry for both sides.

Each call is a handler `(db, ctx, body) -> answer` with a pydantic body and answer; `ctx` says who calls
(`ctx.caller`), with the settings and the queue's Redis. The API serves
each as `POST /v1/worker/<name>` (service/runners/router.py), with a worker credential as the caller; a worker
that still holds the database's URL calls the same handler in-process (worker/control.py DatabaseControl), with
`TRUSTED` as the caller. So there is one protocol, tested both ways, and dropping the database worker drops
nothing else.

A handler commits what it changed itself (a call may take several short transactions, as lease renewals do);
whatever it raises is rolled back. It checks that the caller acts only on its own rows (`own_worker`,
`own_attempt`), and it is idempotent: a call sent again after a lost answer (a retry, an API restart, another
replica) answers as the first did and changes nothing more.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel
from redis import Redis
from sqlalchemy.orm import Session

from service.errors import Forbidden
from service.settings import Settings


class Caller(Protocol):
    """Who calls: a joined machine (service/runners/credentials.Runner) or TRUSTED."""

    name: str

    def owns(self, worker_id: str) -> bool: ...


@dataclass(frozen=True)
class Trusted:
    """A worker holding the database's URL: it could write any row anyway, so the protocol checks nothing of it."""

    name: str = "(database worker)"

    def owns(self, worker_id: str) -> bool:
        return True


TRUSTED = Trusted()

@dataclass(frozen=True)
class Context:
    caller: Caller
    settings: Settings
    redis: Redis  # the queues' (a client connects on its first command)


Handler = Callable[[Session, Context, BaseModel], BaseModel | None]


@dataclass(frozen=True)
class Call:
    name: str
    body: type[BaseModel]
    answer: type[BaseModel] | None  # None: 204, no content
    handler: Handler
    summary: str


CALLS: dict[str, Call] = {}


def call(name: str, *, body: type[BaseModel], answer: type[BaseModel] | None = None) -> Callable[[Handler], Handler]:
    """Register `handler` as the protocol's call `name` (POST /v1/worker/<name>)."""
    def register(handler: Handler) -> Handler:
        assert name not in CALLS, f"the worker protocol's call {name!r} is registered twice"
        CALLS[name] = Call(name, body, answer, handler, (handler.__doc__ or name).strip())
        return handler
    return register


def answer_json(found: Call, answer: BaseModel | None) -> dict | None:
    """What the API would send: the answer as JSON data (so an in-process call returns exactly what HTTP would)."""
    return None if answer is None else found.answer.model_validate(answer).model_dump(mode="json")


def own_worker(caller: Caller, worker_id: str, *, field: str = "worker_id") -> None:
    if not caller.owns(worker_id):
        raise Forbidden(f"worker {worker_id!r} is not runner {caller.name!r}'s: its processes are named "
                        f"{caller.name}, {caller.name}-<pid> and their lanes", field=field)


def own_attempt(db: Session, caller: Caller, *, job_id: str, attempt: int, node_rank: int = 0,
                field: str = "job_id") -> str | None:
    """The worker that runs this node of `attempt` (None: no such attempt); a 403 when it is not the caller's."""
    from service.jobs import lifecycle  # NOTE: lifecycle imports the scheduling layer; keep this module light

    owner = lifecycle.attempt_workers(db, refs=[(job_id, attempt, node_rank)]).get((job_id, attempt, node_rank))
    if owner is not None and not caller.owns(owner):
        raise Forbidden(f"attempt {attempt} (node {node_rank}) of job {job_id} is not runner {caller.name!r}'s",
                        field=field)
    return owner
