"""The API's delivery loop: due outbox rows claimed, POSTed (signed) by a small pool, and settled.

Every API process runs one, beside the sweeper (no Redis lock: the claim's compare-and-set keeps two
processes off one row). It never runs on the request path: a thread of its own and a pool of
TRAINJOBS_WEBHOOK_CONCURRENCY senders, each POST bounded by TRAINJOBS_WEBHOOK_TIMEOUT_S.
Hand-written rather than tenacity: a retry here waits in the database (next_attempt_at), across restarts,
not in a sleeping thread.
"""

import json
import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.db import UNREACHABLE, utcnow
from service.settings import Settings
from service.webhooks import allow, outbox
from service.webhooks.models import Webhook
from trainjobs import webhooks as signing

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 3600.0
PRUNE_BATCHES = 5  # of outbox.prune's 1000 rows, per pass: a pass stays short whatever the backlog
CLAIM_MARGIN_S = 30.0  # a claim outlives a POST's timeout by this much, so only a dead holder's lapses
USER_AGENT = "trainjobs-webhooks/1"


def body_of(hook: Webhook, payload: dict) -> bytes:
    """The bytes POSTed (and signed): the event's JSON, or for `format: slack` a Slack incoming-webhook body."""
    if hook.format == "slack":
        return json.dumps({"text": slack_text(payload)}, separators=(",", ":")).encode()
    return json.dumps(payload, separators=(",", ":")).encode()


def slack_text(payload: dict) -> str:
    """One line: "trainjobs: job lr-3e-4 (0190...) of alice failed (attempt 1, step 20): boom"."""
    job = payload.get("job")
    if job is None:
        return f"trainjobs: {payload['event']} ({payload['id']})"
    step = (job.get("progress") or {}).get("step")
    what = payload["event"].removeprefix("job.")
    # Only a failure's: a retried job's next start still carries the error of the attempt before.
    error = (job.get("error") or {}).get("message") if what == "failed" else None
    return (f"trainjobs: job {job['name']} ({job['id']}) of {job['owner']} {what} (attempt {job['attempt']}"
            f"{f', step {step}' if step else ''})" + (f": {error}" if error else ""))


def send(client: httpx.Client, hook: Webhook, payload: dict, policy: allow.Policy) -> outbox.Outcome:
    """One signed POST to the webhook's URL, at an address the policy admits now (resolved here, and sent to
    that address, so a DNS answer that changed since the check cannot redirect it). Never raises."""
    started = time.monotonic()
    try:
        url = allow.parse(hook.url)
        addresses = allow.resolve(url, policy)
        body = body_of(hook, payload)
        timestamp = int(time.time())
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, "Host": url.netloc.decode(),
                   signing.EVENT_ID: payload["id"], signing.EVENT: payload["event"],
                   signing.TIMESTAMP: str(timestamp), signing.SIGNATURE: signing.sign(hook.secret, timestamp, body)}
        target, extensions = url, {}
        if addresses:  # to the checked address; TLS still names (and verifies) the host
            target = url.copy_with(host=str(addresses[0]))
            if url.scheme == "https":
                extensions["sni_hostname"] = url.host
        with client.stream("POST", target, content=body, headers=headers, extensions=extensions) as response:
            excerpt = b""
            for chunk in response.iter_bytes():
                excerpt += chunk
                if len(excerpt) >= outbox.EXCERPT_CHARS:
                    break
        text = excerpt[:outbox.EXCERPT_CHARS].decode(errors="replace")
        return outbox.Outcome(status_code=response.status_code, response=text, duration_ms=elapsed_ms(started))
    except allow.Refused as exc:
        return outbox.Outcome(error=f"refused: {exc.message}", duration_ms=elapsed_ms(started))
    except httpx.HTTPError as exc:
        return outbox.Outcome(error=f"{type(exc).__name__}: {exc}"[:outbox.EXCERPT_CHARS],
                              duration_ms=elapsed_ms(started))


def elapsed_ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def make_client(settings: Settings) -> httpx.Client:
    # NOTE: redirects are not followed: a 3xx is a failed try, never a way to an address the policy refuses.
    return httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False,
                        limits=httpx.Limits(max_connections=settings.webhook_concurrency))


def backoff_of(settings: Settings) -> outbox.Backoff:
    return outbox.Backoff(settings.webhook_backoff_s, settings.webhook_backoff_max_s, settings.webhook_give_up_s)


def deliver(db: Session, *, delivery_id: int, settings: Settings, client: httpx.Client, by: str) -> str | None:
    """Claim, send and settle one row: its new status, or None if another process has it."""
    claimed = outbox.claim(db, delivery_id=delivery_id, by=by, hold_s=settings.webhook_timeout_s + CLAIM_MARGIN_S)
    if claimed is None:
        return None
    outcome = send(client, claimed.webhook, claimed.delivery.payload, allow.policy_of(settings.webhook_allow))
    status = outbox.settle(db, claimed=claimed, by=by, outcome=outcome, backoff=backoff_of(settings))
    level = logging.INFO if outcome.ok else logging.WARNING
    log.log(level, "webhook %s %s %s: %s", claimed.webhook.id, claimed.delivery.event, claimed.delivery.event_id,
            outcome.status_code or outcome.error)
    return status


class Deliverer:
    """The loop: at most `webhook_concurrency` rows in flight; woken when one settles (its subject's next row
    may be due), else every `webhook_poll_s`."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session]):
        self.settings, self.sessions = settings, sessions
        self.by = f"{socket.gethostname()[:40]}:{os.getpid()}:{secrets.token_hex(4)}"
        self.stop, self.wake = threading.Event(), threading.Event()
        self.inflight: set[int] = set()
        self.lock = threading.Lock()
        self.last_prune = -float("inf")

    def run(self) -> None:
        with make_client(self.settings) as client, ThreadPoolExecutor(self.settings.webhook_concurrency,
                                                                      thread_name_prefix="webhook") as pool:
            while not self.stop.is_set():
                self.wake.clear()
                self.tick(client, pool)
                self.wake.wait(self.settings.webhook_poll_s)

    def tick(self, client: httpx.Client, pool: ThreadPoolExecutor) -> None:
        try:
            with self.lock:
                free = self.settings.webhook_concurrency - len(self.inflight)
            if free > 0:
                with self.sessions() as db:
                    ids = [i for i in outbox.due(db, limit=free + len(self.inflight)) if i not in self.inflight]
                for delivery_id in ids[:free]:
                    with self.lock:
                        self.inflight.add(delivery_id)
                    pool.submit(self.deliver_one, client, delivery_id)
            if time.monotonic() - self.last_prune >= PRUNE_EVERY_S:
                self.prune()
        except UNREACHABLE as exc:
            log.warning("webhook delivery cannot reach the database (%s); will retry", type(exc).__name__)
        except Exception:  # noqa: BLE001 - a failed pass must not stop the loop
            log.exception("webhook delivery pass failed")

    def deliver_one(self, client: httpx.Client, delivery_id: int) -> None:
        try:
            with self.sessions() as db:
                deliver(db, delivery_id=delivery_id, settings=self.settings, client=client, by=self.by)
        except UNREACHABLE as exc:  # the claim lapses; this or another process tries again
            log.warning("webhook delivery %s: database unreachable (%s)", delivery_id, type(exc).__name__)
        except Exception:  # noqa: BLE001 - one row's bug must not stop the others
            log.exception("webhook delivery %s failed", delivery_id)
        finally:
            with self.lock:
                self.inflight.discard(delivery_id)
            self.wake.set()

    def prune(self) -> None:
        before = utcnow() - timedelta(days=self.settings.webhook_keep_days)
        with self.sessions() as db:
            for _ in range(PRUNE_BATCHES):
                if outbox.prune(db, before=before) == 0:
                    break
        self.last_prune = time.monotonic()
