#!/usr/bin/env bash
# Validate docker-compose.yml with docker-compose 1.29.2 (`config -q`), which needs no Docker engine, and check
# that it ships no database credentials (it refuses to start without TRAINJOBS_DATABASE_URL).
# The tool lives in a Python 3.9 venv outside the repo (1.29.2 does not install on 3.11+); made if missing.
# Not part of the test suite. Usage: scripts/check-compose.sh [compose file]
#   DC_VENV=/tmp/dc-venv  PYTHON39=/root/.pyenv/versions/3.9.18/bin/python  to change where things are.
set -euo pipefail

cd "$(dirname "$0")/.."
FILE="${1:-docker-compose.yml}"
VENV="${DC_VENV:-/tmp/dc-venv}"
PY39="${PYTHON39:-/root/.pyenv/versions/3.9.18/bin/python}"

if [ ! -x "$VENV/bin/docker-compose" ]; then
  command -v "$PY39" > /dev/null || PY39="$(command -v python3.9)" \
    || { echo "need a Python 3.9 (set PYTHON39)" >&2; exit 2; }
  echo "creating $VENV with docker-compose 1.29.2"
  "$PY39" -m venv "$VENV"
  # PyYAML 5.4.1 is what 1.29.2 allows (<6); if its sdist ever fails to build, retry with "cython<3".
  "$VENV/bin/pip" install -q 'docker-compose==1.29.2' \
    || "$VENV/bin/pip" install -q 'cython<3' 'PyYAML==5.4.1' 'docker-compose==1.29.2' --no-build-isolation
fi

"$VENV/bin/docker-compose" version --short
# The file ships no database credentials: without TRAINJOBS_DATABASE_URL (the operator's .env, left out here
# through an empty env file) it must refuse, naming the variable.
empty_env="$(mktemp)"
trap 'rm -f "$empty_env"' EXIT
refusal="$(env -u TRAINJOBS_DATABASE_URL "$VENV/bin/docker-compose" -f "$FILE" --env-file "$empty_env" config -q 2>&1)" \
  && refusal=""
if [[ "$refusal" != *"Missing mandatory value"*TRAINJOBS_DATABASE_URL* ]]; then
  echo "$FILE does not refuse to start without TRAINJOBS_DATABASE_URL: no default (a default password) allowed" >&2
  exit 1
fi
TRAINJOBS_DATABASE_URL="${TRAINJOBS_DATABASE_URL:-postgresql+psycopg://trainjobs:placeholder@postgres:5432/trainjobs}" \
  "$VENV/bin/docker-compose" -f "$FILE" config -q
# The worker, where users' code runs, holds no database URL (issue 42): it joins the API with a credential.
rendered="$(TRAINJOBS_DATABASE_URL=postgresql+psycopg://trainjobs:placeholder@postgres:5432/trainjobs \
  "$VENV/bin/docker-compose" -f "$FILE" config)"
"$VENV/bin/python" - "$rendered" <<'PY'
import sys, yaml
services = yaml.safe_load(sys.argv[1])["services"]
worker = services["worker"]
env = worker.get("environment") or {}
assert "TRAINJOBS_DATABASE_URL" not in env, "the worker service must not be given TRAINJOBS_DATABASE_URL"
assert "postgres_password" not in [s if isinstance(s, str) else s["source"] for s in worker.get("secrets", [])]
assert env.get("TRAINJOBS_WORKER_API"), "the worker service joins the API: TRAINJOBS_WORKER_API"
assert "TRAINJOBS_DATABASE_URL" in services["api"]["environment"]
PY
echo "ok: the worker service holds no database URL and joins the API"
echo "ok: $FILE is valid for docker-compose $("$VENV/bin/docker-compose" version --short)"
