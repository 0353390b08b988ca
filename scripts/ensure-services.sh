#!/usr/bin/env bash
# Make sure the services the tests talk to are up: Redis (127.0.0.1:6379, the machine's own, no password), the
# tests' Redis with a password (127.0.0.1:6380) and PostgreSQL (127.0.0.1:5432).
# Starts them with the machine's own commands when they are installed but stopped.
#
# The tests run against a Redis that asks for a password, as the service's always should (docker-compose.yml,
# `trainjobs up`): its password is made once and kept in TEST_REDIS_PASSWORD_FILE (0600); `make test` reads it
# there into TRAINJOBS_TEST_REDIS_URL. It reaches redis-server through a 0600 config file, not its command line.
set -euo pipefail

TEST_REDIS_PORT=6380
TEST_REDIS_PASSWORD_FILE="${TRAINJOBS_TEST_REDIS_PASSWORD_FILE:-/var/lib/redis/trainjobs-test.password}"

redis_up() { python3 - <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", 6379)); s.sendall(b"PING\r\n"); sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}
test_redis_up() {
  REDISCLI_AUTH="$(cat "$TEST_REDIS_PASSWORD_FILE")" redis-cli -h 127.0.0.1 -p "$TEST_REDIS_PORT" ping 2>/dev/null \
    | grep -q PONG
}
pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if ! redis_up; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do redis_up && break; sleep 0.1; done
fi
mkdir -p "$(dirname "$TEST_REDIS_PASSWORD_FILE")"
if [ ! -s "$TEST_REDIS_PASSWORD_FILE" ]; then
  (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > "$TEST_REDIS_PASSWORD_FILE")
fi
if ! test_redis_up; then
  echo "starting the tests' Redis (password in $TEST_REDIS_PASSWORD_FILE)"
  mkdir -p /var/lib/redis /var/log/redis
  conf="${TEST_REDIS_PASSWORD_FILE%.password}.conf"
  (umask 077; printf 'requirepass "%s"\n' "$(cat "$TEST_REDIS_PASSWORD_FILE")" > "$conf")
  redis-server "$conf" --daemonize yes --bind 127.0.0.1 -::1 --port "$TEST_REDIS_PORT" --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci-auth.log
  for _ in $(seq 50); do test_redis_up && break; sleep 0.1; done
fi
if ! pg_up; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 100); do pg_up && break; sleep 0.1; done
fi
redis_up || { echo "Redis is not reachable at 127.0.0.1:6379" >&2; exit 1; }
test_redis_up || { echo "the tests' Redis does not answer at 127.0.0.1:$TEST_REDIS_PORT with the password in" \
  "$TEST_REDIS_PASSWORD_FILE (one with another password already there?)" >&2; exit 1; }
pg_up || { echo "PostgreSQL is not reachable at 127.0.0.1:5432" >&2; exit 1; }
psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" postgres | grep -q 1 \
  || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" postgres
echo "Redis (6379, and $TEST_REDIS_PORT with a password) and PostgreSQL are up"
