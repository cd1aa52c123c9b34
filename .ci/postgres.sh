#!/usr/bin/env bash
# CI only: a throwaway local PostgreSQL for tests/gateway/test_postgres.py.
#
#   STRATA_TEST_PG_URL="$(.ci/postgres.sh)"    # prints the SQLAlchemy URL, nothing else, on stdout
#
# Installs the Debian `postgresql` package when missing, starts its cluster, creates the role
# and database below (a second run finds them and only resets the password) and waits until
# the server accepts TCP on 127.0.0.1. Needs root (or passwordless sudo): it is meant for a
# fresh CI machine, not a developer's. Progress goes to stderr, apt's output to a log file
# shown only on failure. The server listens on loopback only (the Debian default).
set -euo pipefail

PG_ROLE=strata
PG_DB=strata_test
# Not a secret: a throwaway password for a loopback-only server that CI creates and discards.
PG_PASSWORD=ci-only-throwaway-not-a-secret
LOG=${TMPDIR:-/tmp}/strata-ci-postgres.log

say() { echo "postgres.sh: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
# as the postgres superuser (peer auth on the local socket), from a directory it may enter
as_pg() { (cd / && if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -n -u postgres "$@"; fi); }
psql_pg() { as_pg psql -X -q -v ON_ERROR_STOP=1 -At "$@"; }
fail() { say "$*"; [ -s "$LOG" ] && tail -n 30 "$LOG" >&2; exit 1; }

t0=$SECONDS
: >"$LOG"
server_versions() { find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -n; }
if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(server_versions)" ]; then
    say "installing postgresql (apt) ..."
    as_root apt-get update -q >>"$LOG" 2>&1 || fail "apt-get update failed"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >>"$LOG" 2>&1 \
        || fail "apt-get install postgresql failed"
fi

# the newest installed server version; its "main" cluster (created by the package, else here)
version=$(server_versions | tail -n 1)
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {found = 1} END {exit !found}'; then
    as_root pg_createcluster "$version" main >>"$LOG" 2>&1 || fail "pg_createcluster $version main failed"
fi
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" && $4 ~ /^online/ {up = 1} END {exit !up}'; then
    as_root pg_ctlcluster "$version" main start >>"$LOG" 2>&1 || fail "pg_ctlcluster $version main start failed"
fi
port=$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {print $3}')
for _ in $(seq 1 60); do
    pg_isready -q -h 127.0.0.1 -p "$port" && break
    sleep 0.5
done
pg_isready -q -h 127.0.0.1 -p "$port" || fail "PostgreSQL $version does not accept connections on 127.0.0.1:$port"

# role and database: create when missing; always (re)set the password so the URL below works
if [ "$(psql_pg -p "$port" -c "SELECT 1 FROM pg_roles WHERE rolname = '$PG_ROLE'")" != 1 ]; then
    psql_pg -p "$port" -c "CREATE ROLE $PG_ROLE LOGIN" || fail "cannot create role $PG_ROLE"
fi
psql_pg -p "$port" -c "ALTER ROLE $PG_ROLE WITH LOGIN PASSWORD '$PG_PASSWORD'" || fail "cannot set the password of $PG_ROLE"
if [ "$(psql_pg -p "$port" -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'")" != 1 ]; then
    psql_pg -p "$port" -c "CREATE DATABASE $PG_DB OWNER $PG_ROLE" || fail "cannot create database $PG_DB"
fi
# the tests connect over TCP with the password (scram-sha-256 in Debian's pg_hba.conf)
PGPASSWORD=$PG_PASSWORD psql -X -q -At -h 127.0.0.1 -p "$port" -U "$PG_ROLE" -d "$PG_DB" -c "SELECT 1" >/dev/null \
    || fail "cannot log in as $PG_ROLE over TCP on 127.0.0.1:$port"

say "PostgreSQL $version ready on 127.0.0.1:$port, database $PG_DB ($((SECONDS - t0)) s)"
echo "postgresql+psycopg://$PG_ROLE:$PG_PASSWORD@127.0.0.1:$port/$PG_DB"
