#!/usr/bin/env bash
# Make sure the services the tests talk to are up: Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432).
# Starts them with the machine's own commands when they are installed but stopped.
set -euo pipefail

redis_up() { python3 - <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", 6379)); s.sendall(b"PING\r\n"); sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}
pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

if ! redis_up; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do redis_up && break; sleep 0.1; done
fi
if ! pg_up; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 100); do pg_up && break; sleep 0.1; done
fi
redis_up || { echo "Redis is not reachable at 127.0.0.1:6379" >&2; exit 1; }
pg_up || { echo "PostgreSQL is not reachable at 127.0.0.1:5432" >&2; exit 1; }
psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" postgres | grep -q 1 \
  || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" postgres
echo "Redis and PostgreSQL are up"
