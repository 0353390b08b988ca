"""The fair pool's reads and its usage: the snapshot the policy plans on, usage folded in (what a plan writes on
the jobs, pending reasons and preemption asks, is service/jobs/pending.py's).

The policy (policy.py) is pure; this module turns rows into its snapshot. Usage is kept per owner as decayed
device-seconds of closed attempts (`usage`, folded in by the sweeper, one writer), plus the running attempts'
so far and those closed since the last fold, added when a snapshot is read.
"""

import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.auth.models import User
from service.db import utcnow
from service.jobs.models import Attempt, Job
from service.scheduling import live, placement, policy
from service.scheduling.models import Team, Usage
from service.settings import Settings
from service.workers import fit, holds
from trainjobs.spec import JobSpec
from trainjobs.states import AttemptStatus, JobStatus

log = logging.getLogger(__name__)
MAX_WAITING = 2000  # queued jobs planned per snapshot, oldest first (the rest wait for a later pass)
REQS_KEPT = 10_000  # jobs' needs a caller's cache remembers (a job's spec and plan never change), then prunes
FOLD_BATCH = 500  # closed attempts folded into usage per sweeper pass


@dataclass(frozen=True)
class Req:
    """What a job asks of the pool, from its spec and plan (neither ever changes: cached by job id)."""

    need: fit.Need
    timeout_s: float
    spec_priority: str
    preemptible: bool


def req_of(spec: JobSpec, plan: dict | None) -> Req:
    return Req(fit.need_of(spec, plan), spec.timeout_s, spec.priority, spec.preemptible)


def _seconds(t: datetime | None) -> float | None:
    return t.timestamp() if t is not None else None


def policy_settings(settings: Settings) -> policy.Settings:
    return policy.Settings(policy=settings.scheduler_policy, preempt_after_s=settings.preempt_after_s,
                           min_runtime_s=settings.min_runtime_s, reserve_after_s=settings.reserve_after_s,
                           reserve_deadline_s=settings.reserve_deadline_s,
                           max_reservations=settings.max_reservations,
                           nvlink_whole_jobs=settings.nvlink_whole_jobs)


def snapshot(db: Session, settings: Settings, *, cache: MutableMapping[str, Req] | None = None) -> policy.Snapshot:
    """The pool as the policy sees it now: queued jobs, jobs holding workers, live workers, usage, accounts.

    `cache`: the caller's, kept from one snapshot to the next (a sweeper's, a worker's), so a job's spec and plan
    are read and parsed once, not at every pass (2,000 queued jobs: 480 of a pass's 600 ms were that)."""
    cache = {} if cache is None else cache
    now = utcnow()
    queued = db.execute(select(Job.id, Job.owner, Job.priority, Job.created_at, Job.queued_at, Job.not_before)
                        .where(Job.status == JobStatus.QUEUED).order_by(Job.created_at, Job.id)
                        .limit(MAX_WAITING)).all()
    holding = db.execute(select(Job.id, Job.owner, Job.status, Job.started_at, Job.progress, Job.attempt,
                                Job.preempt_requested_at).where(Job.status.in_([JobStatus.STARTING,
                                                                                JobStatus.RUNNING]))).all()
    # Every attempt not yet in `usage`: the active ones, and those closed since the sweeper last folded.
    attempts = db.execute(select(Attempt.job_id, Attempt.number, Attempt.worker, Attempt.started_at,
                                 Attempt.finished_at, Attempt.status, Job.owner)
                          .join(Job, Job.id == Attempt.job_id).where(Attempt.charged.is_(False))).all()
    if len(cache) > REQS_KEPT:  # forget the jobs that left (clearing it all made the next pass parse every spec)
        current = {r.id for r in (*queued, *holding)} | {a.job_id for a in attempts}
        for job_id in [j for j in cache if j not in current]:
            del cache[job_id]
    missing = list({r.id for r in (*queued, *holding) if r.id not in cache}
                   | {a.job_id for a in attempts if a.job_id not in cache})
    for i in range(0, len(missing), 500):
        for job_id, spec, plan in db.execute(select(Job.id, Job.spec, Job.plan)
                                             .where(Job.id.in_(missing[i:i + 500]))):
            cache[job_id] = req_of(spec, plan)
    # A draining worker takes no more jobs, nor does one under pressure (its disk full) until it recovers: live.py.
    nodes, claiming = live.live_nodes(db, lost_after_s=settings.lease_s)

    by_job: dict[str, list] = {}
    in_flight: dict[str, float] = {}
    for a in attempts:
        if a.status == AttemptStatus.ACTIVE:
            by_job.setdefault(a.job_id, []).append(a)
        seconds = ((a.finished_at or now) - a.started_at).total_seconds()
        in_flight[a.owner] = in_flight.get(a.owner, 0.0) + cache[a.job_id].need.slots * max(0.0, seconds)
    running = []
    for r in holding:
        req = cache[r.id]
        mine = [a for a in by_job.get(r.id, []) if a.number == r.attempt]
        eta = (r.progress or {}).get("eta_s")
        running.append(policy.Running(
            id=r.id, owner=r.owner, spec_priority=req.spec_priority, slots=req.need.slots, nodes=req.need.nodes,
            started=_seconds(r.started_at) or now.timestamp(), timeout_s=req.timeout_s,
            workers=tuple(a.worker for a in mine), need=req.need, eta_s=eta,
            preemptible=req.preemptible and r.status == JobStatus.RUNNING,
            preempt_requested=r.preempt_requested_at is not None))
    waiting = [policy.Waiting(id=r.id, owner=r.owner, priority=r.priority, spec_priority=cache[r.id].spec_priority,
                              submitted=r.created_at.timestamp(),
                              queued=(_seconds(r.queued_at) or r.created_at.timestamp()), need=cache[r.id].need,
                              timeout_s=cache[r.id].timeout_s, not_before=_seconds(r.not_before))
               for r in queued]
    # A queued job that holds devices is being claimed: its worker counts it, so the plan must not place it again
    # (a queue read just before its entry was taken still lists it).
    if claiming:
        waiting = [w for w in waiting if w.id not in claiming]
    owners = {j.owner for j in waiting} | {r.owner for r in running}
    usage = usage_now(db, now=now, half_life_s=settings.fair_share_half_life_s)
    for owner, extra in in_flight.items():
        usage[owner] = usage.get(owner, 0.0) + extra
    accounts, teams = accounts_of(db, owners | set(usage))
    return policy.Snapshot(now=now.timestamp(), waiting=waiting, running=running, nodes=nodes, usage=usage,
                           accounts=accounts, teams=teams, settings=policy_settings(settings))


def room_of(slots: int, max_jobs: int, load: holds.Load | None, devices: list[dict] | None = None) -> int | None:
    """A shared worker's free slots (none once it runs max_jobs jobs); None for a worker of one job at a time.

    `devices`: the worker row's, as its heartbeat reports them: an unhealthy one is no room."""
    if max_jobs <= 1:
        return None
    load = load or holds.Load()
    if load.jobs >= max_jobs:
        return 0
    # NOTE: a held device that turns unhealthy counts twice until its job, stopped for it, gives it back (seconds):
    # the room errs small then, never onto a bad device.
    unhealthy = sum(1 for d in devices or [] if not d.get("healthy", True))
    return max(0, slots - load.slots - unhealthy)


def machine_of(worker_id: str, kind: str, rows: list[dict] | None) -> placement.Machine | None:
    """A worker's devices and their links as placement sees them, from its row (worker/devices.py as_rows); None
    without rows. A GPU row names its links; CPU slots link as placement.cpu_machine links them (one NUMA node
    near, across nodes far), which their NUMA nodes tell."""
    if not rows:
        return None
    devices = tuple(placement.Device(d["index"], d.get("uuid") or str(d["index"]), d.get("memory_bytes"),
                                     d.get("healthy", True), d.get("numa_node"), d.get("reason"),
                                     tuple(d.get("cores") or ())) for d in rows)
    if kind != "cuda":
        return placement.Machine(worker_id, kind, devices, _NumaLinks(devices))
    links = {(d["index"], int(other)): _link(link) for d in rows for other, link in (d.get("links") or {}).items()}
    return placement.Machine(worker_id, kind, devices, links)


_link = lru_cache(maxsize=64)(placement.Link.parse)  # a pool's rows repeat a handful of words


class _NumaLinks(Mapping):
    """CPU slots' links as placement.cpu_machine makes them (near on one NUMA node, or everywhere when no node is
    known; far across nodes), computed when asked: a snapshot reads every shared worker, and a 64-slot one
    has 4,032 pairs, of which a plan asks for a few."""

    NEAR = placement.Link(placement.Level.NODE)

    def __init__(self, devices: tuple[placement.Device, ...]):
        self.numa = {d.index: d.numa_node for d in devices}
        self.known = any(n is not None for n in self.numa.values())

    def __getitem__(self, pair: tuple[int, int]) -> placement.Link:
        a, b = pair
        if a == b or a not in self.numa or b not in self.numa:
            raise KeyError(pair)
        same = self.numa[a] is not None and self.numa[a] == self.numa[b]
        return self.NEAR if not self.known or same else placement.UNKNOWN

    def __iter__(self):
        return ((a, b) for a in self.numa for b in self.numa if a != b)

    def __len__(self) -> int:
        return len(self.numa) * (len(self.numa) - 1)


def devices_of(worker_id: str, kind: str, rows: list[dict] | None, held: dict[int, tuple[str, int]]) -> dict:
    """A shared worker's Node fields for device-level reservations: its machine, its free devices (healthy, held
    by no job) and each job's held devices; {} where its row lists no devices (a worker of an earlier version)."""
    machine = machine_of(worker_id, kind, rows)
    if machine is None:
        return {}
    by_job: dict[str, set[int]] = {}
    for device, (job, _) in held.items():
        by_job.setdefault(job, set()).add(device)
    free = frozenset(d.index for d in machine.devices if d.healthy and d.index not in held)
    return {"machine": machine, "free_devices": free, "held": {j: frozenset(ds) for j, ds in by_job.items()}}


def queued_among(db: Session, job_ids: list[str]) -> set[str]:
    """Which of these jobs are queued (a queue entry of any other is stale: its job ran, ended or is gone)."""
    found: set[str] = set()
    for i in range(0, len(job_ids), 1000):
        found.update(db.scalars(select(Job.id).where(Job.id.in_(job_ids[i:i + 1000]),
                                                     Job.status == JobStatus.QUEUED)))
    return found


def usage_now(db: Session, *, now: datetime, half_life_s: float) -> dict[str, float]:
    """Every owner's stored usage, decayed to now (closed attempts only)."""
    return {u.owner: policy.decayed(u.device_seconds, (now - u.as_of).total_seconds(), half_life_s)
            for u in db.scalars(select(Usage))}


def accounts_of(db: Session, owners: set[str]) -> tuple[dict[str, policy.Account], dict[str, policy.Team]]:
    accounts = {u.name: policy.Account(team=u.team, weight=u.weight or 1.0, max_slots=u.max_slots)
                for u in db.scalars(select(User).where(User.name.in_(owners)))} if owners else {}
    teams = {t.name: policy.Team(weight=t.weight or 1.0, max_slots=t.max_slots) for t in db.scalars(select(Team))}
    return accounts, teams


def fold_usage(db: Session, *, half_life_s: float, batch: int = FOLD_BATCH) -> int:
    """Charge closed attempts' device-seconds (slots × seconds) to their owners' usage; the sweeper's, one writer.

    The caller commits. An attempt is charged once: the flag and the usage change in one transaction.
    """
    rows = db.execute(select(Attempt.id, Attempt.started_at, Attempt.finished_at, Job.owner, Job.spec)
                      .join(Job, Job.id == Attempt.job_id)
                      .where(Attempt.finished_at.is_not(None), Attempt.charged.is_(False))
                      .order_by(Attempt.finished_at).limit(batch)).all()
    if not rows:
        return 0
    now = utcnow()
    charges: dict[str, float] = {}
    for r in rows:
        seconds = max(0.0, (r.finished_at - r.started_at).total_seconds())
        charges[r.owner] = charges.get(r.owner, 0.0) + r.spec.resources.nproc_per_node * seconds
    stored = {u.owner: u for u in db.scalars(select(Usage).where(Usage.owner.in_(list(charges)))
                                            .with_for_update())}
    for owner, seconds in charges.items():
        row = stored.get(owner)
        if row is None:
            db.add(Usage(owner=owner, device_seconds=seconds, as_of=now))
        else:
            row.device_seconds = policy.decayed(row.device_seconds, (now - row.as_of).total_seconds(),
                                                half_life_s) + seconds
            row.as_of = now
    db.execute(update(Attempt).where(Attempt.id.in_([r.id for r in rows])).values(charged=True))
    return len(rows)
