"""What authentication costs a request: the same reads with auth on (a bearer token) and off, in one run.

Two apps on one PostgreSQL database, in process (Starlette's TestClient: no network, no other process, so
the difference is the server's own work): one with TRAINJOBS_AUTH on, one with it off (everyone the local
admin, loopback only). Alternating rounds of GET /v1/jobs/{id} (the token looked up by its hash, then the job
checked against its owner) and GET /v1/jobs (the list, filtered by owner); median latency of each, and the
ratios on / off. The job and token this bench makes are deleted at the end.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import delete

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentile, postgres_url, redis_url  # noqa: E402
from service import migrate  # noqa: E402
from service.api.app import create_app  # noqa: E402
from service.auth import tokens  # noqa: E402
from service.auth.models import ApiToken, User  # noqa: E402
from service.db import make_engine, make_sessionmaker  # noqa: E402
from service.jobs.models import Job  # noqa: E402
from service.settings import Settings  # noqa: E402

SPEC = {"name": "auth-bench", "model": {"type": "mlp", "hidden": [16]},
        "data": {"type": "synthetic_regression", "num_samples": 256, "batch_size": 8}, "train": {"max_steps": 10}}


def timed(client: TestClient, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        r = client.get(path)
        out.append(time.perf_counter() - started)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200, help="per route per round")
    args = parser.parse_args()
    url = postgres_url()
    migrate.upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions() as db:  # a user's token (not an admin's): the reads filter by owner, as most callers' do
        made_user = db.get(User, "bench-auth") is None
        _row, secret = tokens.create(db, name="bench-auth", user="bench-auth")
        db.commit()
    with tempfile.TemporaryDirectory(prefix="trainjobs-bench-") as tmp:
        common = {"database_url": url, "redis_url": redis_url(), "queue_prefix": "benchauth", "reconcile_s": 3600}
        on = Settings(data_dir=Path(tmp) / "on", **common)
        off = Settings(data_dir=Path(tmp) / "off", auth=False, **common)
        # base_url 127.0.0.1: the auth-off app serves loopback only, and checks the server address.
        with TestClient(create_app(on), base_url="http://127.0.0.1") as with_auth, \
                TestClient(create_app(off), base_url="http://127.0.0.1") as without:
            with_auth.headers["Authorization"] = f"Bearer {secret}"
            job_id = with_auth.post("/v1/jobs", json=SPEC).json()["id"]
            with_auth.post(f"/v1/jobs/{job_id}/cancel")  # a finished job: every read sees the same row
            # The same rows both ways: the user's list holds its own job; the local admin asks for that owner's.
            routes = {f"/v1/jobs/{job_id}": {"on": f"/v1/jobs/{job_id}", "off": f"/v1/jobs/{job_id}"},
                      "/v1/jobs?limit=20": {"on": "/v1/jobs?limit=20", "off": "/v1/jobs?limit=20&owner=bench-auth"}}
            clients = {"on": with_auth, "off": without}
            samples = {(mode, name): [] for mode in clients for name in routes}
            for paths in routes.values():  # warm both: connection pools, first-use imports
                for mode, client in clients.items():
                    timed(client, paths[mode], 20)
            for i in range(args.rounds):
                for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    for name, paths in routes.items():
                        samples[(mode, name)] += timed(clients[mode], paths[mode], args.requests)
    with sessions() as db:  # what this bench made
        db.execute(delete(Job).where(Job.id == job_id))
        db.execute(delete(ApiToken).where(ApiToken.name == "bench-auth"))
        if made_user:
            db.execute(delete(User).where(User.name == "bench-auth"))
        db.commit()
    engine.dispose()

    print(f"PostgreSQL {url.rsplit('@', 1)[-1]}; in-process TestClient, {args.rounds} alternating rounds of "
          f"{args.requests} requests per route")
    for name in routes:
        med = {m: statistics.median(samples[(m, name)]) * 1000 for m in ("on", "off")}
        p95 = {m: percentile(samples[(m, name)], 0.95) * 1000 for m in ("on", "off")}
        print(f"  GET {name.replace(job_id, '{id}')}: median on / off {med['on'] / med['off']:.2f} "
              f"[{med['on']:.2f} vs {med['off']:.2f} ms, +{med['on'] - med['off']:.2f} ms]; "
              f"p95 {p95['on']:.2f} vs {p95['off']:.2f} ms")


if __name__ == "__main__":
    main()
