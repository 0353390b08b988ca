"""Workers in the database: register, heartbeat, occupy and release, list (the database is the truth)."""

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import case, delete, select, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.errors import Forbidden
from service.workers import fit, holds
from service.workers.models import Worker
from trainjobs.errors import InvalidRequest
from trainjobs.plan import WorkerMemory
from trainjobs.spec import JobSpec

PRUNE_AFTER_S = 3600.0  # a lost worker stays listed (as lost) this long, then its row goes


def register(db: Session, *, worker_id: str, host: str, address: str, device: str, slots: int,
             memory_bytes: int | None, host_memory_bytes: int | None, labels: dict[str, str], max_jobs: int = 1,
             devices: list[dict] | None = None, runner: str | None = None) -> None:
    """Insert or refresh this worker's row. A restart under the same name keeps the holds of attempts still
    active (a worker back after an outage runs them yet) and drops the rest. The caller commits."""
    now = utcnow()
    db.merge(Worker(id=worker_id, host=host, address=address, device=device, slots=slots, busy_slots=0,
                    memory_bytes=memory_bytes, host_memory_bytes=host_memory_bytes, labels=labels,
                    state="idle", current_job=None, started_at=now, last_seen=now, max_jobs=max_jobs,
                    devices=devices, runner=runner))
    db.flush()
    holds.sweep(db, worker_id=worker_id)
    holds.sync_worker(db, worker_id=worker_id)


def beat(db: Session, *, worker_id: str, draining: bool = False, pressure: str | None = None,
         devices: list[dict] | None = None, images: list[str] | None = None) -> bool:
    """Renew last_seen (and say so when draining, and why it takes no jobs: `pressure`, None once it takes them
    again; its devices, when their health changed; the images it has unpacked, when they changed); False when the
    row is gone (pruned): register again."""
    values: dict = {"last_seen": utcnow(), "pressure": pressure[:512] if pressure else None}
    if devices is not None:
        values["devices"] = devices
    if images is not None:
        values["images"] = images
    if draining:
        values["state"] = "draining"
    if db.execute(update(Worker).where(Worker.id == worker_id).values(**values)).rowcount != 1:
        return False
    holds.sweep(db, worker_id=worker_id)  # what a lost attempt of it left
    return True


def occupy(db: Session, *, worker_id: str, job_id: str, slots: int) -> None:
    """The worker took a job (in the claim's transaction). Where it took the job's devices first (holds.take, a
    worker that knows its devices), its holds say how many slots it holds: counting the job's slots on top would
    show twice as many until the bind after the claim."""
    db.execute(update(Worker).where(Worker.id == worker_id).values(
        current_job=job_id, busy_slots=Worker.busy_slots + slots, last_seen=utcnow(),
        state=case((Worker.state == "draining", "draining"), else_="busy")))
    if any(job == job_id for job, _ in holds.held(db, worker_id=worker_id).values()):
        holds.sync_worker(db, worker_id=worker_id)


def release(db: Session, *, worker_id: str, job_id: str, node_rank: int | None = None) -> None:
    """The worker is done with job_id (one node of it): its devices go back, and its row says what it still holds."""
    holds.release(db, worker_id=worker_id, job_id=job_id, node_rank=node_rank)


def device_rows(db: Session, *, worker_id: str) -> list[dict]:
    """Its devices as its heartbeat last reported them (their health included); [] without a row."""
    return db.scalar(select(Worker.devices).where(Worker.id == worker_id)) or []


def exists(db: Session, *, worker_id: str) -> bool:
    return db.scalar(select(Worker.id).where(Worker.id == worker_id)) is not None


def remove(db: Session, *, worker_id: str) -> None:
    """A worker that stops cleanly leaves the list at once."""
    db.execute(delete(Worker).where(Worker.id == worker_id))


def is_lost(worker: Worker, *, now: datetime, lost_after_s: float) -> bool:
    return (now - worker.last_seen).total_seconds() > lost_after_s


def shown_state(worker: Worker, *, now: datetime, lost_after_s: float) -> str:
    return "lost" if is_lost(worker, now=now, lost_after_s=lost_after_s) else worker.state


def list_workers(db: Session) -> list[Worker]:
    return list(db.scalars(select(Worker).order_by(Worker.id)))


def live(db: Session, *, lost_after_s: float) -> list[Worker]:
    """Workers heard from within lost_after_s (the lease: a worker silent that long is lost)."""
    since = utcnow() - timedelta(seconds=lost_after_s)
    return list(db.scalars(select(Worker).where(Worker.last_seen >= since).order_by(Worker.id)))


def prune(db: Session, *, older_than_s: float = PRUNE_AFTER_S) -> int:
    """Forget workers lost for a long while (the caller commits)."""
    since = utcnow() - timedelta(seconds=older_than_s)
    return db.execute(delete(Worker).where(Worker.last_seen < since)).rowcount


def live_memory(db: Session, *, lost_after_s: float) -> list[WorkerMemory]:
    """Every worker heard from within lost_after_s, as the planner sees it (from the workers table)."""
    return memory_of(live(db, lost_after_s=lost_after_s))


def memory_of(workers: Sequence[Worker]) -> list[WorkerMemory]:
    return [WorkerMemory(device="cuda" if w.device == "cuda" else "cpu",
                         gpu_count=w.slots if w.device == "cuda" else 0,
                         gpu_memory_bytes=w.memory_bytes if w.device == "cuda" else None,
                         host_memory_bytes=w.host_memory_bytes)
            for w in workers]


def plans_against_workers(spec: JobSpec) -> bool:
    """Whether the job's memory plan needs the live workers: a model to plan and no gpu_memory_gb in the spec."""
    return spec.model is not None and not spec.resources.gpu_memory_gb


def memory_for(db: Session, *, spec: JobSpec, lost_after_s: float) -> list[WorkerMemory]:
    """The live workers, when the plan needs them (plans_against_workers)."""
    return live_memory(db, lost_after_s=lost_after_s) if plans_against_workers(spec) else []


def needs_pip(spec: JobSpec) -> bool:
    return fit.need_of(spec, None).pip


def check_pip(spec: JobSpec, *, live_workers: Sequence[Worker]) -> None:
    """A job with requirements needs a live worker that installs them (TRAINJOBS_ALLOW_PIP), else a 422 now.

    Once accepted, it waits in the queue like any job no worker fits, with a pending_reason, should those
    workers go away before it runs.
    """
    if needs_pip(spec) and not any((w.labels or {}).get(fit.PIP_LABEL) == "true" for w in live_workers):
        raise InvalidRequest("no live worker installs a job's requirements: an operator starts one with "
                             "TRAINJOBS_ALLOW_PIP=1 and TRAINJOBS_ALLOW_ENTRYPOINTS=1 (or ship the dependencies "
                             "in the package, or drop entrypoint.requirements)", field="entrypoint.requirements")


WAIT_HINT = ("; or submit with allow_unschedulable=true (`trainjobs submit/run --allow-unschedulable`) to wait for "
             "such a worker")


def check_schedulable(spec: JobSpec, *, live_workers: Sequence[Worker]) -> None:
    """A job that no live worker could run a node of is refused now, naming what it asks that none has, as Slurm
    refuses a job that no node of its partition could ever run: 403 for users' own code on a pool that runs none,
    else a 422 naming the field. With no live worker at all (a pool starting) it is taken, and waits. The caller
    skips this for a submission that says it will wait for such a worker."""
    live = [w for w in live_workers if w.state != "draining"]
    need = fit.need_of(spec, None)  # (the memory plan has its own 422)
    fitting = [w for w in live if fit.misfit(need, w) is None]
    if not live or len(fitting) >= need.nodes:
        return
    if fitting:  # a gang of more nodes than the pool has workers that fit: each node is one worker
        raise InvalidRequest(f"needs {need.nodes} nodes; {len(fitting)} live worker(s) fit one "
                             f"({', '.join(sorted(w.id for w in fitting))[:300]})" + WAIT_HINT,
                             field="resources.nnodes")
    if need.entrypoint and not any((w.labels or {}).get(fit.ENTRYPOINTS_LABEL) == "true" for w in live):
        raise Forbidden("no live worker runs users' own code: an operator starts workers with "
                        "TRAINJOBS_ALLOW_ENTRYPOINTS=1" + WAIT_HINT, field="entrypoint")
    kinds = sorted({w.device for w in live})
    if need.device != "auto" and need.device not in kinds:
        raise InvalidRequest(f"no live worker has device {need.device}: the pool has {len(live)} "
                             f"{'/'.join(kinds)} worker(s)" + WAIT_HINT, field="resources.device")
    same = [w for w in live if need.device in ("auto", w.device)]
    largest = max(same, key=lambda w: w.slots)
    if largest.slots < need.slots:
        raise InvalidRequest(f"needs {need.slots} processes per node; the largest live worker ({largest.id}) offers "
                             f"{largest.slots}" + WAIT_HINT, field="resources.nproc_per_node")
    misses = "; ".join(f"{w.id}: {m}" for w in live if (m := fit.misfit(need, w)))[:400]
    field = "resources.selector" if need.labels else "resources"
    raise InvalidRequest(f"no live worker fits ({misses})" + WAIT_HINT, field=field)
