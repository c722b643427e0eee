#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for tests and CI, from Debian's `postgresql` binaries.
#
#   deploy/postgres-test-server.sh start <dir> <port>   init <dir>/data, start, create db `dagster`;
#                                                       prints the DAGSTER_PG_* settings (env lines)
#   deploy/postgres-test-server.sh stop  <dir> <port>   stop the server (the files stay in <dir>)
#
# Trust authentication, user `dagster`, database `dagster`, listening on 127.0.0.1:<port> only.
# As root, the server runs as the `postgres` system user: <dir> is handed to that user, and every
# folder above it must be traversable by it (/tmp/<name> is; pytest's /tmp/pytest-of-root is not).
# PG_BIN overrides where initdb and pg_ctl are found.
set -euo pipefail

usage() { echo "usage: $0 start|stop <dir> <port>" >&2; exit 2; }
[ $# -eq 3 ] || usage
cmd=$1 dir=$2 port=$3
case $port in ''|*[!0-9]*) echo "$0: port must be a number, got '$port'" >&2; exit 2;; esac

PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
if [ -z "$PG_BIN" ] || [ ! -x "$PG_BIN/initdb" ] || [ ! -x "$PG_BIN/pg_ctl" ]; then
  echo "$0: no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin;" \
       "install Debian's package: apt-get install -y postgresql (or set PG_BIN)" >&2
  exit 3
fi

as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

data=$dir/data
log=$dir/postgres.log
sock=$dir/socket

case $cmd in
  start)
    mkdir -p "$dir"
    if [ "$(id -u)" -eq 0 ]; then
      id postgres >/dev/null 2>&1 || { echo "$0: running as root needs the 'postgres' system user" >&2; exit 3; }
      chown postgres: "$dir"
      if ! runuser -u postgres -- test -w "$dir"; then
        echo "$0: user postgres cannot write $dir: a folder above it is not traversable by that user;" \
             "use a folder such as /tmp/<name>" >&2
        exit 3
      fi
    fi
    if [ ! -f "$data/PG_VERSION" ]; then
      as_owner "$PG_BIN/initdb" -D "$data" -U dagster --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    fi
    as_owner mkdir -p "$sock"
    if ! as_owner "$PG_BIN/pg_ctl" -D "$data" -l "$log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $sock -c fsync=off -c full_page_writes=off -c synchronous_commit=off" start >/dev/null; then
      echo "$0: PostgreSQL did not start on 127.0.0.1:$port; its log:" >&2
      cat "$log" >&2 || true
      exit 1
    fi
    if ! as_owner "$PG_BIN/psql" -h 127.0.0.1 -p "$port" -U dagster -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'dagster'" | grep -q 1; then
      as_owner "$PG_BIN/createdb" -h 127.0.0.1 -p "$port" -U dagster dagster
    fi
    echo "DAGSTER_PG_HOST=127.0.0.1"
    echo "DAGSTER_PG_PORT=$port"
    echo "DAGSTER_PG_USER=dagster"
    echo "DAGSTER_PG_PASSWORD=dagster"  # trust authentication ignores it; dagster needs it set
    echo "DAGSTER_PG_DB=dagster"
    ;;
  stop)
    if [ -f "$data/postmaster.pid" ]; then
      as_owner "$PG_BIN/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null
    fi
    ;;
  *) usage ;;
esac
