"""A small HTTP client for the CLI: every command talks to the API, never to the database."""

import time
import uuid
from collections.abc import Iterator

import httpx

from service.jobs.status import TERMINAL


class APIError(Exception):
    def __init__(self, status: int, detail):
        super().__init__(f"HTTP {status}: {format_detail(detail)}")
        self.status, self.detail = status, detail


def format_detail(detail) -> str:
    if isinstance(detail, list):  # pydantic's errors: name each field at fault
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg')}" for e in detail)
    return str(detail)


class Client:
    def __init__(self, base_url: str, timeout: float = 30):
        self.http = httpx.Client(base_url=base_url, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise APIError(response.status_code, detail)
        return response

    def submit(self, spec: dict, *, attempts: int = 3) -> dict:
        """Submit once, even if the connection drops: every retry carries the same Idempotency-Key."""
        headers = {"Idempotency-Key": f"cli-{uuid.uuid4()}"}
        for attempt in range(1, attempts + 1):
            try:
                return self._call("POST", "/v1/jobs", json=spec, headers=headers).json()
            except httpx.TransportError:
                if attempt == attempts:
                    raise
                time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")

    def plan(self, spec: dict) -> dict:
        return self._call("POST", "/v1/plan", json=spec).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def list(self, status: str | None = None, limit: int = 20) -> dict:
        params = {"limit": limit} | ({"status": status} if status else {})
        return self._call("GET", "/v1/jobs", params=params).json()

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def metrics(self, job_id: str, name: str | None = None) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params={"name": name} if name else {}).json()

    def logs(self, job_id: str, offset: int = 0) -> tuple[str, int, str]:
        r = self._call("GET", f"/v1/jobs/{job_id}/logs", params={"offset": offset})
        return r.text, int(r.headers["X-Next-Offset"]), r.headers["X-Job-Status"]

    def follow_logs(self, job_id: str, poll_s: float = 0.5) -> Iterator[str]:
        offset = 0
        while True:
            text, offset, status = self.logs(job_id, offset)
            if text:
                yield text
            elif status in TERMINAL:
                return
            else:
                time.sleep(poll_s)
