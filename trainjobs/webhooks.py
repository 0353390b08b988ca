"""A webhook's signature, as Stripe signs: what the API sends and what a receiver checks (stdlib only).

    from trainjobs.webhooks import verify
    ok = verify(secret, request.headers, raw_body)     # in the receiver, on the body's bytes as received

The signed text is the timestamp, a dot and the body, so a captured request cannot be replayed later with
another timestamp; a receiver refuses timestamps older than `tolerance_s` and deduplicates by the event id
(delivery is at least once).
"""

import hashlib
import hmac
import time
from collections.abc import Mapping

TIMESTAMP = "X-Trainjobs-Timestamp"
SIGNATURE = "X-Trainjobs-Signature"
EVENT_ID = "X-Trainjobs-Event-Id"
EVENT = "X-Trainjobs-Event"
TOLERANCE_S = 300


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """`sha256=<hex of HMAC-SHA256(secret, "<timestamp>." + body)>`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, tolerance_s: float = TOLERANCE_S,
           now: float | None = None) -> bool:
    """Whether a delivery's headers sign this body with this secret, at a time within tolerance_s of now."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        timestamp = int(lower[TIMESTAMP.lower()])
        signature = lower[SIGNATURE.lower()]
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)
