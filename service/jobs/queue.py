"""The only module that talks to RQ: enqueue, drop, reconcile with the database, and the workers' own queues.

A job's entry waits on its priority queue until the scheduler's pass (service/jobs/assigner.py) assigns it: then
it moves, in one step, onto that worker's own queue (`<prefix>-w-<worker id>`), which only that worker's lanes
listen to. A gang's other nodes are assigned by the same pass; once node 0 claims the job, the pass puts each
node's task on the queue of the worker it assigned it to (`hand_nodes`).
"""

import logging
from collections.abc import Sequence
from datetime import timedelta

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job as RQJob
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from service.db import utcnow
from service.jobs.models import Attempt, Job
from service.scheduling.assignments import Assignment
from trainjobs.states import AttemptStatus, JobStatus

log = logging.getLogger(__name__)

# The worker's job function, by dotted name: the control plane never imports worker/.
JOB_FUNCTION = "worker.agent.run_job"
PRIORITIES = ("high", "normal", "low")
# RQ must never kill a job before our supervisor does (it enforces timeout_s and the grace period).
RQ_TIMEOUT_MARGIN_S = 600
CHECK_BATCH = 1000  # queue entries whose jobs' status one query of reconcile reads
FINISHING_S = 30  # how long a work-horse may take from recording an outcome to RQ marking the job done


# The queue where a forming gang's node tasks once waited for any worker that fit them. Nothing puts an entry there
# now (the pass assigns every node); a worker of this version still pops it (worker/main.py names it), so an entry
# an earlier version left there is judged as any other on its own queue: refused or stale, never run by fit.
GANG = "gang"
NODE_FUNCTION = "worker.agent.run_node"  # a gang's node 1.. (a node task: job, attempt, node rank)

# What a queue entry may ask a worker to run, and with what arguments: RQ imports and calls whatever dotted
# name an entry's hash holds, so an entry that anything able to reach Redis pushed (a job's script, with a
# password-less Redis) would run in the worker's work-horse. Workers run these two and nothing else.
JOB_FUNCTIONS = {JOB_FUNCTION: (str,), NODE_FUNCTION: (str, int, int)}
SECURITY = "SECURITY"  # the word that starts every log line about a refused queue entry


def refusal(rq_job: RQJob) -> str | None:
    """Why a worker must not run this queue entry (None: it is one of ours, as the service writes them)."""
    try:
        func_name, instance, args, kwargs = rq_job.serializer.loads(rq_job.data)
    except Exception as exc:  # noqa: BLE001 - whatever a forged payload makes the serializer raise
        return f"an unreadable payload ({type(exc).__name__})"
    types = JOB_FUNCTIONS.get(func_name)
    if types is None:
        return f"function {func_name!r} is not a trainjobs job function"
    if instance is not None or kwargs or not isinstance(args, (list, tuple)) or len(args) != len(types) or any(
            type(a) is not t for a, t in zip(args, types, strict=True)):
        return f"{func_name} with arguments the service never writes"
    expected = args[0] if func_name == JOB_FUNCTION else node_task_id(*args)
    if rq_job.id != expected:
        return f"entry {rq_job.id!r} names job {args[0]!r}"
    callbacks = [n for n in (rq_job._success_callback_name, rq_job._failure_callback_name,
                             rq_job._stopped_callback_name) if n]
    if callbacks or rq_job._dependency_ids:
        return f"callbacks or dependencies the service never writes ({callbacks or rq_job._dependency_ids})"
    return None


class GuardedJob(RQJob):
    """RQ's Job that imports only the two job functions, whatever its hash says: the last line of defence
    behind the dispatcher's check (worker/dispatch.py), wherever RQ itself reaches for a job's function."""

    @property
    def func(self):
        if (why := refusal(self)) is not None:
            raise PermissionError(f"{SECURITY}: refusing queue entry {self.id}: {why}")
        return super().func

    def _get_callback(self, name: str | None):
        if name:
            raise PermissionError(f"{SECURITY}: refusing queue entry {self.id}: a callback {name!r}")
        return None

    @property
    def success_callback(self):
        return self._get_callback(self._success_callback_name)

    @property
    def failure_callback(self):
        return self._get_callback(self._failure_callback_name)

    @property
    def stopped_callback(self):
        return self._get_callback(self._stopped_callback_name)


def queue_names(prefix: str) -> list[str]:
    """Queue names in the order a worker serves them."""
    return [f"{prefix}-{p}" for p in PRIORITIES]


def worker_queue_name(prefix: str, worker_id: str) -> str:
    """A worker's own queue: the entries of the jobs the scheduler assigned to it."""
    return f"{prefix}-w-{worker_id}"


def worker_queue(redis: Redis, prefix: str, worker_id: str) -> Queue:
    return Queue(worker_queue_name(prefix, worker_id), connection=redis, serializer=JSONSerializer)


# Move an entry from one queue to another in one step: LREM from KEYS[1] (every copy: an entry enqueued twice moves
# once), then RPUSH onto KEYS[2] only if it was there (gone meanwhile: nothing moves). Returns how many LREM removed.
_HAND = """
local n = redis.call('LREM', KEYS[1], 0, ARGV[1])
if n > 0 then redis.call('RPUSH', KEYS[2], ARGV[1]) end
return n
"""
def hand_to_workers(redis: Redis, *, prefix: str, moves: Sequence[tuple[str, str, str]]) -> list[bool]:
    """Move each (job id, priority, worker id)'s entry from its priority queue onto the worker's own queue, each
    move atomic, all in one round trip; False for one its priority queue no longer held (taken by an earlier
    version's worker, dropped by a cancel, lost with Redis)."""
    if not moves:
        return []
    with redis.pipeline(transaction=False) as pipe:
        for job_id, priority, worker_id in moves:
            pipe.eval(_HAND, 2, get_queue(redis, prefix, priority).key, worker_queue(redis, prefix, worker_id).key,
                      job_id)
        return [n > 0 for n in pipe.execute()]


def off_worker_queue(redis: Redis, *, prefix: str, entry: str, worker_id: str) -> int:
    """An assigned job's entry (a node task's) off the worker's queue (an assignment undone); 0 when the worker had
    taken it off already (or it was never put there). LREM decides between the pass and the worker's pop."""
    return redis.lrem(worker_queue(redis, prefix, worker_id).key, 0, entry)


def priority_entries(redis: Redis, prefix: str, *, limit: int = 5000) -> dict[str, str]:
    """The ids on the priority queues (their first `limit` each), with their priority; one round trip."""
    with redis.pipeline(transaction=False) as pipe:
        for priority in PRIORITIES:
            pipe.lrange(get_queue(redis, prefix, priority).key, 0, limit - 1)
        found = pipe.execute()
    out: dict[str, str] = {}
    for priority, ids in zip(PRIORITIES, found, strict=True):
        for i in ids:
            out.setdefault(i.decode() if isinstance(i, bytes) else i, priority)
    return out


KICK = "{prefix}:assign:kick"


def kick(redis: Redis, *, prefix: str, pipe=None) -> None:
    """Ask for a scheduling pass soon (a job queued, devices freed, a worker ready): a list of at most one item
    that the pass's loop waits on (wait_for_kick)."""
    target = pipe if pipe is not None else redis.pipeline(transaction=False)
    target.lpush(KICK.format(prefix=prefix), 1)
    target.ltrim(KICK.format(prefix=prefix), 0, 0)
    if pipe is None:
        target.execute()


def wait_for_kick(redis: Redis, *, prefix: str, timeout_s: float) -> bool:
    """Until a kick or `timeout_s`; True when kicked (the kick is spent)."""
    return redis.blpop([KICK.format(prefix=prefix)], timeout=max(0.01, timeout_s)) is not None


def node_task_id(job_id: str, attempt: int, node_rank: int) -> str:
    return f"{job_id}-{attempt}-{node_rank}"


def parse_node_task_id(task_id: str) -> tuple[str, int, int] | None:
    job_id, _, rest = task_id.partition("-")
    attempt, _, node_rank = rest.partition("-")
    return (job_id, int(attempt), int(node_rank)) if attempt.isdigit() and node_rank.isdigit() else None


def enqueue_nodes(redis: Redis, *, prefix: str, job_id: str, attempt: int, nnodes: int, timeout_s: float) -> None:
    """Node 0 of a gang claimed `attempt` (the claim calls this): a pass now, which hands nodes 1..nnodes-1 to the
    workers it assigned them to (`hand_nodes`)."""
    kick(redis, prefix=prefix)


def hand_nodes(redis: Redis, *, prefix: str, nodes: Sequence[tuple[str, int, int, str, float]]) -> list[str]:
    """Put each (job id, attempt, node rank, worker id, timeout_s)'s node task on the worker's own queue, unless it
    is there already (its hash exists: handed by an earlier pass, or taken); returns the tasks put there now.

    NOTE: only a hint, like every queue entry: a task lost with Redis is handed again by the next pass while its
    node has not joined, and a node that never joins undoes the gang (service/jobs/assigner.py).
    """
    if not nodes:
        return []
    ids = [node_task_id(job_id, attempt, rank) for job_id, attempt, rank, _, _ in nodes]
    with redis.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.exists(RQJob.key_for(task_id))
        there = pipe.execute()
    handed = []
    with redis.pipeline() as pipe:
        for task_id, (job_id, attempt, rank, worker_id, timeout_s), found in zip(ids, nodes, there, strict=True):
            if found:
                continue
            worker_queue(redis, prefix, worker_id).enqueue_call(
                NODE_FUNCTION, args=[job_id, attempt, rank], job_id=task_id,
                timeout=int(timeout_s) + RQ_TIMEOUT_MARGIN_S, result_ttl=600, failure_ttl=3600,
                description=f"trainjobs job {job_id} attempt {attempt} node {rank}", pipeline=pipe)
            handed.append(task_id)
        pipe.execute()
    return handed


def drop_node_task(redis: Redis, *, task_id: str) -> None:
    """A node task's hash, while RQ says it waits (never taken: its assignment undone); a hash RQ marked started or
    finished is the bookkeeping of a real run, and keeps its TTL."""
    try:
        rq_job = RQJob.fetch(task_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        return
    if rq_job.get_status(refresh=False) == "queued":
        rq_job.delete(remove_from_queue=False)


def get_queue(redis: Redis, prefix: str, priority: str) -> Queue:
    return Queue(f"{prefix}-{priority}", connection=redis, serializer=JSONSerializer)


def enqueue(redis: Redis, *, prefix: str, job_id: str, priority: str, timeout_s: float) -> None:
    """Put a committed job on its priority queue; the RQ job id is our job id."""
    enqueue_many(redis, prefix=prefix, jobs=[(job_id, priority, timeout_s)])


def put_back(db: Session, redis: Redis, *, prefix: str, job_id: str) -> bool:
    """A queued job's entry again (its claim could not be made now); False when it is no longer queued."""
    job = db.get(Job, job_id)
    if job is None or job.status != JobStatus.QUEUED:
        return False
    enqueue(redis, prefix=prefix, job_id=job_id, priority=job.priority, timeout_s=job.spec.timeout_s)
    return True


def enqueue_many(redis: Redis, *, prefix: str, jobs: Sequence[tuple[str, str, float]]) -> None:
    """enqueue of each (job id, priority, timeout_s), in one round trip (MULTI/EXEC): RQ's own enqueue takes two
    a job (the queue's name in the set of queues, then the job's hash and the push)."""
    if not jobs:
        return
    with redis.pipeline() as pipe:
        for job_id, priority, timeout_s in jobs:
            get_queue(redis, prefix, priority).enqueue_call(
                JOB_FUNCTION,
                args=[job_id],
                job_id=job_id,
                timeout=int(timeout_s) + RQ_TIMEOUT_MARGIN_S,
                result_ttl=3600,
                failure_ttl=24 * 3600,
                description=f"trainjobs job {job_id}",
                pipeline=pipe,
            )
        kick(redis, prefix=prefix, pipe=pipe)  # a pass assigns them soon, not at its next tick
        pipe.execute()


def drop(redis: Redis, *, prefix: str, job_id: str, priority: str) -> None:
    """Remove a job from its queue (a cancel of a queued job); a no-op if it is gone."""
    get_queue(redis, prefix, priority).remove(job_id)
    try:
        RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer).delete()
    except NoSuchJobError:
        pass


def reconcile(db: Session, redis: Redis, *, prefix: str, min_age_s: float | None = 10.0) -> list[str]:
    """Enqueue every due queued job that no RQ queue holds; drop queue entries of finished or unknown jobs.

    Due: a retry whose backoff is over (not_before), or a job queued over `min_age_s` ago. Younger jobs are
    left alone: their API request may still be enqueueing them. min_age_s None: retries only (a quick pass).
    """
    now = utcnow()
    due = and_(Job.not_before.is_not(None), Job.not_before <= now)
    if min_age_s is not None:
        due = or_(due, and_(Job.not_before.is_(None), Job.queued_at <= now - timedelta(seconds=min_age_s)))
    # NOTE: ids and priorities only, the spec read for the few missing: with thousands queued (a sweep's
    # trials), whole rows (each spec parsed) and a query per queue entry made the pass seconds of CPU.
    # A job the scheduler assigned waits on its worker's queue (or its worker has taken it): the pass undoes an
    # assignment that went astray, and puts its entry back itself.
    assigned = select(Assignment.job_id).where(Assignment.job_id == Job.id).exists()
    rows = db.execute(select(Job.id, Job.priority).where(Job.status == JobStatus.QUEUED, due, ~assigned)).all()
    held: dict[str, str] = {}
    if rows or min_age_s is not None:  # the quick pass with no retry due reads no queue
        for priority in PRIORITIES:
            held.update(dict.fromkeys(get_queue(redis, prefix, priority).get_job_ids(), priority))
    missing = []
    for job_id, priority in rows:
        if job_id in held or _finishing(db, redis, job_id, now):
            continue
        # A lost worker's RQ job still sits in its started registry; RQ's own cleanup would later mark
        # the id failed under the new attempt's feet.
        _forget_executions(redis, prefix=prefix, job_id=job_id, priority=priority)
        spec = db.scalar(select(Job.spec).where(Job.id == job_id))
        enqueue(redis, prefix=prefix, job_id=job_id, priority=priority, timeout_s=spec.timeout_s)
        missing.append(job_id)
    if missing:
        log.info("enqueued %d queued job(s) that no queue held: %s", len(missing), missing)
    if min_age_s is not None:
        entries, unknown = list(held), []
        for i in range(0, len(entries), CHECK_BATCH):
            chunk = entries[i:i + CHECK_BATCH]
            status_of = dict(db.execute(select(Job.id, Job.status).where(Job.id.in_(chunk))).all())
            for job_id in chunk:
                status = status_of.get(job_id)
                if status is None or JobStatus(status).is_terminal():
                    get_queue(redis, prefix, held[job_id]).remove(job_id)
                    log.info("dropped queue entry %s (job %s)", job_id, status or "unknown")
                if status is None:
                    unknown.append(job_id)
        if unknown:
            say_shared(redis, prefix=prefix, job_ids=unknown)
    return missing


SHARED_KEY = "{prefix}:shared"  # what say_shared last said, for /readyz
SHARED_TTL_S = 600


def say_shared(redis: Redis, *, prefix: str, job_ids: list[str]) -> None:
    """Queue entries of jobs this database never had: another stack (another database) shares this Redis db and
    queue prefix, and each side's workers and reconciler take and drop the other's entries, so both starve in
    silence. Said in a warning and, for SHARED_TTL_S, in /readyz's `warnings`."""
    message = (f"{len(job_ids)} queue entr{'y' if len(job_ids) == 1 else 'ies'} (e.g. {job_ids[0]}) name no job in "
               f"this database: another trainjobs stack with its own database shares this Redis db and queue "
               f"prefix {prefix!r}, and the two take and drop each other's jobs. Give each stack its own Redis db "
               "(TRAINJOBS_REDIS_URL=redis://host:6379/N) or TRAINJOBS_QUEUE_PREFIX")
    log.warning(message)
    redis.set(SHARED_KEY.format(prefix=prefix), message, ex=SHARED_TTL_S)


def shared_warning(redis: Redis, *, prefix: str) -> str | None:
    """What say_shared said in the last SHARED_TTL_S, if anything."""
    said = redis.get(SHARED_KEY.format(prefix=prefix))
    return said.decode() if isinstance(said, bytes) else said


def _finishing(db: Session, redis: Redis, job_id: str, now) -> bool:
    """The previous attempt's work-horse is still wrapping up (it recorded the outcome a moment ago)."""
    finished = db.scalar(select(func.max(Attempt.finished_at)).where(Attempt.job_id == job_id,
                                                                     Attempt.status != AttemptStatus.LOST))
    if finished is None or (now - finished).total_seconds() > FINISHING_S:
        return False
    try:
        return RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer).get_status() == "started"
    except NoSuchJobError:
        return False


def _forget_executions(redis: Redis, *, prefix: str, job_id: str, priority: str) -> None:
    try:
        rq_job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        return
    StartedJobRegistry(queue=get_queue(redis, prefix, priority)).remove_executions(rq_job)
