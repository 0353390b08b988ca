"""bench/control_plane.py's smoke run (--quick: 20 simulated workers × 8 devices for 3 s) reports every measure."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[1]


def test_control_plane_bench_quick_reports_every_measure(postgres_url, redis, tmp_path):
    out = tmp_path / "control_plane.json"
    env = {"PATH": "/usr/bin:/bin", "TRAINJOBS_BENCH_REDIS_URL": REDIS_URL}
    run = subprocess.run([sys.executable, "bench/control_plane.py", "--quick", "--keep-schema", "--url", postgres_url,
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.read_text())
    (step,) = results["steps"]
    assert step["n"] == 20 and step["devices"] == 160
    for kind in ("beat", "lease", "ship", "poll"):
        op = step["ops"][kind]
        assert op["offered_per_s"] > 0 and op["achieved_per_s"] > 0, kind
        assert op["errors"] == 0 and op["lost"] == 0, kind
        assert math.isfinite(op["p50_ms"]) and math.isfinite(op["p99_ms"]), kind
        assert math.isfinite(op["pg_cpu_ms_per_op"]) and math.isfinite(op["client_cpu_ms_per_op"]), kind
    assert set(step["pg_cpu_cores"]) >= {"beat", "lease", "ship", "poll", "api", "server", "total"}
    assert step["pg_cpu_cores"]["total"] > 0
    assert step["points"] > 0 and step["db_growth_bytes"] > 0
    for read in ("api_workers", "api_running"):
        assert step[read]["calls"] > 0 and math.isfinite(step[read]["p99_ms"]), read
    reads = step["api_cpu_ms_per_read"]
    assert {"workers", "running", "sweeper_cores"} <= set(reads) and reads["workers_bytes"] > 0
    assert results["max_connections"] > 0
    (demand,) = results["demand"]
    assert demand["pg_cores_at_offered"] > 0 and demand["connections_real"] == 20 + 2 * 160 + 50
    for line in ("PostgreSQL CPU (cores)", "GET /v1/workers", "GET /v1/jobs?status=running", "ship p99"):
        assert line in run.stdout, line
