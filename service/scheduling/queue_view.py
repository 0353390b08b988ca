"""GET /v1/queue's view (issue 42): what one plan says of every queued job, kept in Redis by the scheduling pass.

The pass (service/jobs/assigner.py) renders the view from the plan it assigns by and stores it as JSON with its
time and a TTL of a few sweep_s, so every API replica serves the same answer and no request plans the pool again.
The route (router.py) filters it per caller (a user sees their own jobs, counts of the others). Without a fresh
view (a fresh start, Redis flushed, no pass running) the route plans once on its own snapshot (`plan_now`) and
says so (`planned_by: request`).

The pass plans the queued jobs not assigned yet (assign.for_pass); the view also lists, first, those it assigned
in earlier passes that their workers are claiming (starting now), so it shows every queued job its snapshot read.

A request that comes right after a submission waits (READ_WAIT_S at most) for a pass that began after the newest
queued job was queued: the submission kicked one, which comes within a pass's time, so a user sees the job they
just submitted (`wait_newer`).
"""

import json
import logging
import time
from collections.abc import Collection

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session

from service.scheduling import policy
from service.scheduling import service as scheduling
from service.settings import Settings

log = logging.getLogger(__name__)
VIEW_KEY = "{prefix}:queue:view"
MIN_TTL_S = 5.0
READ_WAIT_S = 1.0  # the longest a request waits for the pass a submission kicked


def ttl_of(settings: Settings) -> float:
    """How long a pass's view is served: a few passes (one runs at least every min(sweep_s, 2) s)."""
    return max(MIN_TTL_S, 4 * settings.sweep_s)


def render(snap: policy.Snapshot, plan: policy.Plan, *, policy_name: str, planned_by: str,
           number: int | None = None, assigned: Collection[str] = ()) -> dict:
    """The view of every queued job in `snap` (the pass's full snapshot): `assigned` (by earlier passes, being
    claimed) first, starting now, then the plan's order; JSON-ready."""
    waiting = {w.id: w for w in snap.waiting}
    now = snap.now
    rows: list[tuple[str, str | None, float | None]] = []  # (job, reason, estimated start)
    first = [j for j in dict.fromkeys(assigned) if j in waiting]
    rows += [(j, None, now) for j in first]
    seen = set(first)
    rows += [(p.job_id, p.reason, p.estimated_start) for p in plan.order if p.job_id not in seen]
    jobs = [{"position": i + 1, "id": j, "owner": waiting[j].owner, "priority": waiting[j].priority, "reason": why,
             "estimated_start": eta} for i, (j, why, eta) in enumerate(rows) if j in waiting]
    return {"planned_at": now, "planned_by": planned_by, "pass": number, "policy": policy_name, "jobs": jobs,
            "usage": snap.usage, "shares": plan.shares, "team_shares": plan.team_shares,
            "accounts": {u: [a.team, a.weight, a.max_slots] for u, a in snap.accounts.items()},
            "reservations": [{"job_id": r.job_id, "owner": waiting[r.job_id].owner if r.job_id in waiting else None,
                              "workers": len(r.workers), "held": r.held, "fill_at": r.fill_at,
                              "deadline": r.deadline, "devices": {w: list(d) for w, d in r.devices.items()}}
                             for r in plan.reservations]}


def store(redis: Redis, *, prefix: str, view: dict, ttl_s: float) -> None:
    """The pass's view, for every API replica, for `ttl_s`."""
    redis.set(VIEW_KEY.format(prefix=prefix), json.dumps(view, separators=(",", ":")), px=int(ttl_s * 1000))


def load(redis: Redis, *, prefix: str) -> dict | None:
    """The last pass's view while it is fresh; None without one (or without Redis)."""
    try:
        raw = redis.get(VIEW_KEY.format(prefix=prefix))
    except RedisError as exc:
        log.warning("the queue view is out of reach in Redis (%s); planning on this request", type(exc).__name__)
        return None
    return json.loads(raw) if raw else None


def wait_newer(redis: Redis, *, prefix: str, view: dict, after: float, timeout_s: float = READ_WAIT_S) -> dict:
    """`view`, or the first view planned after `after` (seconds since the epoch) that comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while view["planned_at"] < after and time.monotonic() < deadline:
        time.sleep(0.02)
        view = load(redis, prefix=prefix) or view
    return view


def plan_now(db: Session, settings: Settings) -> dict:
    """The fallback: one plan on this request's own snapshot (every queued job), as before the pass kept one."""
    snap = scheduling.snapshot(db, settings)
    return render(snap, policy.plan(snap), policy_name=settings.scheduler_policy, planned_by="request")
