"""Secrets never reach the logs: the worker's secret values are cut out of what it ships, and kept from ranks.

A value counts as secret if its variable's name says so (TOKEN, SECRET, PASSWORD, KEY, CREDENTIAL), or if it
is the password inside a URL (a database or Redis URL). Ranks get no service connection strings at all:
they report through files (TRAINJOBS_METRICS_FILE), never to the database.
"""

import re
from collections.abc import Mapping
from urllib.parse import unquote, urlparse

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH", re.I)
# The service's own connections and credentials: a user's script has no business with them.
SERVICE_ONLY = ("TRAINJOBS_DATABASE_URL", "TRAINJOBS_REDIS_URL", "TRAINJOBS_TOKEN", "TRAINJOBS_SECRETS_DIR",
                "DATABASE_URL", "REDIS_URL", "TRAINJOBS_WORKER_CREDENTIAL_FILE", "TRAINJOBS_WORKER_TICK_SOCKET")
MIN_LEN = 6  # shorter values would redact ordinary words
MASK = "[redacted]"


def secret_values(env: Mapping[str, str]) -> list[str]:
    found = set()
    for name, value in env.items():
        if not value:
            continue
        if SECRET_NAME.search(name) and len(value) >= MIN_LEN:
            found.add(value)
        if "://" in value:
            try:
                password = urlparse(value).password
            except ValueError:
                password = None
            if password and len(password) >= MIN_LEN:
                found |= {password, unquote(password)}
    return sorted(found, key=len, reverse=True)  # longest first: a secret containing another goes whole


class Redactor:
    def __init__(self, env: Mapping[str, str]):
        values = secret_values(env)
        self.pattern = re.compile("|".join(map(re.escape, values))) if values else None

    def __call__(self, text: str) -> str:
        return self.pattern.sub(MASK, text) if self.pattern else text


def rank_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SERVICE_ONLY}
