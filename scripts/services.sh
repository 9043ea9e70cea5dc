#!/usr/bin/env bash
# Starts the services outbox-relay's quickstart, tests and benchmarks use, installing
# what is missing. Idempotent: running it again leaves running services alone.
#
#   PostgreSQL 15  a project-owned cluster with wal_level=logical on 127.0.0.1:${OUTBOX_RELAY_PG_PORT:-55432}
#   RabbitMQ       the machine's server on 127.0.0.1:5672 (started if down)
#   Kafka          tansu (a Kafka-protocol broker, in-memory storage) on 127.0.0.1:${OUTBOX_RELAY_KAFKA_PORT:-9092}
#
#   scripts/services.sh start               all three (what scripts/test.sh needs)
#   scripts/services.sh start rabbitmq      PostgreSQL and RabbitMQ only
#   scripts/services.sh start kafka         PostgreSQL and the Kafka-protocol broker only
#
# PostgreSQL is always started. Naming the broker matters on a fresh machine: tansu is built
# from source the first time (about 15 minutes), which the RabbitMQ path does not need.
#
# State lives under ${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}. `scripts/services.sh stop` stops
# what this script started (the machine's RabbitMQ is left running).
set -euo pipefail

STATE=${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}
PG_PORT=${OUTBOX_RELAY_PG_PORT:-55432}
KAFKA_PORT=${OUTBOX_RELAY_KAFKA_PORT:-9092}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
TANSU_VERSION=0.6.0
PGDATA="$STATE/pg"

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # port seconds what
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    port_open "$1" && return 0
    sleep 0.1
  done
  die "$3 did not open port $1 within $2 s"
}

as_pg_owner() { # run a PostgreSQL server binary as a non-root user
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

apt_install() {
  [ "$(id -u)" = 0 ] || die "missing packages $*; install them (apt-get install $*)"
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}

ensure_packages() {
  local missing=()
  [ -x "$PG_BIN/initdb" ] || missing+=(postgresql)
  command -v psql >/dev/null || missing+=(postgresql-client)
  if [ "$WANT_RABBITMQ" = 1 ]; then
    command -v rabbitmq-server >/dev/null || missing+=(rabbitmq-server)
  fi
  # librdkafka (built by rdkafka-sys) needs these headers and tools.
  dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
  dpkg -s zlib1g-dev >/dev/null 2>&1 || missing+=(zlib1g-dev)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  command -v make >/dev/null || missing+=(make)
  command -v cc >/dev/null || missing+=(gcc)
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
  PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)}
}

start_postgres() {
  mkdir -p "$STATE"
  if [ "$(id -u)" = 0 ]; then chown postgres "$STATE" 2>/dev/null || true; chmod 755 "$STATE"; fi
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    log "creating PostgreSQL cluster in $PGDATA"
    rm -rf "$PGDATA"
    as_pg_owner "$PG_BIN/initdb" -D "$PGDATA" -A trust -U postgres --no-sync -E UTF8 >/dev/null
    cat >>"$PGDATA/postgresql.conf" <<CONF
# outbox-relay test cluster
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$STATE'
wal_level = logical
max_replication_slots = 64
max_wal_senders = 64
max_connections = 300
wal_sender_timeout = 30s
shared_buffers = 256MB
max_slot_wal_keep_size = 4GB
CONF
  fi
  if as_pg_owner "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    log "PostgreSQL already running on 127.0.0.1:$PG_PORT"
  else
    log "starting PostgreSQL on 127.0.0.1:$PG_PORT"
    # The default port lies in Linux's range for outgoing connections, so
    # a client's socket can hold it for a moment: try again a few times.
    local try
    for try in 1 2 3 4 5; do
      as_pg_owner "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$STATE/pg.log" -w -t 60 start >/dev/null && break
      grep -q 'Address already in use' "$STATE/pg.log" && [ "$try" -lt 5 ] ||
        die "PostgreSQL did not start; see $STATE/pg.log"
      log "127.0.0.1:$PG_PORT is in use; trying again in 3 s"
      sleep 3
    done
  fi
  local level
  level=$(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atc 'SHOW wal_level')
  [ "$level" = logical ] || die "cluster on $PG_PORT has wal_level=$level, expected logical"
}

start_rabbitmq() {
  if port_open 5672 && rabbitmqctl -q status >/dev/null 2>&1; then
    log "RabbitMQ already running on 127.0.0.1:5672"
    return
  fi
  log "starting RabbitMQ"
  rabbitmq-server -detached >/dev/null 2>&1 || true
  timeout 120 rabbitmqctl -q await_startup >/dev/null 2>&1 || die "RabbitMQ did not start"
  wait_port 5672 60 RabbitMQ
}

ensure_tansu() {
  if command -v tansu >/dev/null 2>&1 && tansu --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
    return
  fi
  if [ -x "$HOME/.cargo/bin/tansu" ]; then export PATH="$HOME/.cargo/bin:$PATH"; return; fi
  log "building tansu $TANSU_VERSION (a Kafka-protocol broker); the first build takes about 15 minutes"
  cargo install "tansu@$TANSU_VERSION" --locked --features dynostore,libsql >"$STATE/tansu-install.log" 2>&1 ||
    die "cargo install tansu failed; see $STATE/tansu-install.log"
}

start_kafka() {
  mkdir -p "$STATE"
  if port_open "$KAFKA_PORT"; then
    log "Kafka-protocol broker already listening on 127.0.0.1:$KAFKA_PORT"
    return
  fi
  ensure_tansu
  log "starting tansu on 127.0.0.1:$KAFKA_PORT"
  nohup tansu broker \
    --storage-engine memory://tansu/ \
    --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    >"$STATE/tansu.log" 2>&1 </dev/null &
  echo $! >"$STATE/tansu.pid"
  wait_port "$KAFKA_PORT" 60 tansu
}

stop_all() {
  if [ -f "$STATE/tansu.pid" ]; then kill "$(cat "$STATE/tansu.pid")" 2>/dev/null || true; rm -f "$STATE/tansu.pid"; fi
  if [ -s "$PGDATA/PG_VERSION" ]; then as_pg_owner "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast stop >/dev/null 2>&1 || true; fi
  log "stopped"
}

WANT_RABBITMQ=0
WANT_KAFKA=0
choose_brokers() { # the arguments after `start`; none means every broker
  [ $# -gt 0 ] || set -- rabbitmq kafka
  local b
  for b in "$@"; do
    case "$b" in
      rabbitmq) WANT_RABBITMQ=1 ;;
      kafka) WANT_KAFKA=1 ;;
      *) die "unknown broker \"$b\"; usage: $0 start [rabbitmq] [kafka]" ;;
    esac
  done
}

case "${1:-start}" in
  start)
    # One start at a time: a second caller (another terminal, a benchmark next to
    # the tests) waits here instead of building tansu or creating the cluster twice,
    # then finds everything running. flock holds the lock; -o keeps it from the
    # servers started below, which outlive this script.
    if [ -z "${OUTBOX_RELAY_SERVICES_LOCKED:-}" ]; then
      mkdir -p "$STATE"
      OUTBOX_RELAY_SERVICES_LOCKED=1 exec flock -o "$STATE/services.lock" "$0" "$@"
    fi
    shift || true
    choose_brokers "$@"
    export PATH="$HOME/.cargo/bin:$PATH"
    ensure_packages
    start_postgres
    echo "OUTBOX_RELAY_TEST_PG=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
    if [ "$WANT_RABBITMQ" = 1 ]; then
      start_rabbitmq
      echo "OUTBOX_RELAY_TEST_AMQP=amqp://guest:guest@127.0.0.1:5672/%2f"
    fi
    if [ "$WANT_KAFKA" = 1 ]; then
      start_kafka
      echo "OUTBOX_RELAY_TEST_KAFKA=127.0.0.1:$KAFKA_PORT"
    fi
    ;;
  stop) stop_all ;;
  *) die "usage: $0 start [rabbitmq] [kafka] | $0 stop" ;;
esac
