#!/usr/bin/env bash
# One command from a fresh clone to events flowing:
#
#   scripts/quickstart.sh [kafka|rabbitmq]      (default: kafka)
#
# Starts PostgreSQL and the chosen broker only (scripts/services.sh start <broker>), builds the
# relay and the `tail` example, creates the database outbox_demo and its outbox table
# (`outbox-relay migrate`), starts the relay with config/polling-<broker>.toml and a consumer,
# inserts a few events the way an application would, shows them arriving and marked sent, then
# stops the relay with SIGTERM.
#
# Running it again is fine: the database, table and topic are reused, and a relay or consumer
# left by an earlier run is stopped first. Logs and pid files go to
# ${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}/quickstart-*.
set -euo pipefail

usage() { echo "usage: $0 [kafka|rabbitmq]"; }

BROKER=${1:-kafka}
case "$BROKER" in
  kafka | rabbitmq) ;;
  -h | --help) usage; exit 0 ;;
  *) echo "quickstart: unknown broker \"$BROKER\"" >&2; usage >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

STATE=${OUTBOX_RELAY_STATE:-/var/tmp/outbox-relay}
PG_PORT=${OUTBOX_RELAY_PG_PORT:-55432}
KAFKA=127.0.0.1:${OUTBOX_RELAY_KAFKA_PORT:-9092}
AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f
DB=outbox_demo
CONFIG=config/polling-$BROKER.toml
TOPIC=outbox.event.order # the config's topic template for aggregate type 'order'
EXCHANGE=outbox          # the config's exchange
TARGET=${CARGO_TARGET_DIR:-target} # where cargo puts what it builds
RELAY=$TARGET/release/outbox-relay
TAIL=$TARGET/release/examples/tail
RELAY_LOG=$STATE/quickstart-relay.log
RELAY_PID=$STATE/quickstart-relay.pid
TAIL_OUT=$STATE/quickstart-tail.out
TAIL_ERR=$STATE/quickstart-tail.err
TAIL_PID=$STATE/quickstart-tail.pid
WAIT=30 # seconds, for each thing waited on

# The config files name the default ports; follow services.sh when they are moved.
if [ "$PG_PORT" != 55432 ]; then
  export OUTBOX_RELAY__DATABASE__URL="postgres://postgres@127.0.0.1:$PG_PORT/$DB"
fi
if [ "$BROKER" = kafka ] && [ "$KAFKA" != 127.0.0.1:9092 ]; then
  export OUTBOX_RELAY__SINK__BROKERS=$KAFKA
fi

STEP=0
step() { STEP=$((STEP + 1)); printf '\n==> %d/9 %s\n' "$STEP" "$*"; }
note() { printf '    %s\n' "$*"; }
indent() { sed 's/^/    /'; }

psql_demo() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres -d "$DB" "$@"; }

fail() {
  printf '\nquickstart: error at step %d: %s\n' "$STEP" "$*" >&2
  if [ -s "$RELAY_LOG" ]; then
    printf '\nlast lines of the relay log (%s):\n' "$RELAY_LOG" >&2
    tail -n 25 "$RELAY_LOG" | indent >&2
  fi
  if [ -s "$TAIL_ERR" ]; then
    printf '\nconsumer (%s):\n' "$TAIL_ERR" >&2
    tail -n 10 "$TAIL_ERR" | indent >&2
  fi
  exit 1
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# Stops the process recorded in a pid file, if it is still the program we started.
stop_recorded() { # pidfile program seconds
  local pid i
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  if alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < $3 * 10; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      note "$2 (pid $pid) did not stop within $3 s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$1"
}

# On any exit, leave nothing running. The relay is normally stopped by the last step.
cleanup() {
  stop_recorded "$TAIL_PID" "$TAIL" 5
  stop_recorded "$RELAY_PID" "$RELAY" 40
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_for_line() { # file pattern pid what
  local i
  for ((i = 0; i < WAIT * 10; i++)); do
    grep -q -- "$2" "$1" 2>/dev/null && return 0
    alive "$3" || return 1
    sleep 0.1
  done
  fail "no $4 within $WAIT s"
}

started=$SECONDS
mkdir -p "$STATE"
# A relay or consumer of an earlier run would compete with this one.
stop_recorded "$TAIL_PID" "$TAIL" 5
stop_recorded "$RELAY_PID" "$RELAY" 40
# So that a failure shows this run's logs only.
rm -f "$RELAY_LOG" "$TAIL_OUT" "$TAIL_ERR"

if [ "$BROKER" = kafka ]; then
  step "starting PostgreSQL and a Kafka-protocol broker (scripts/services.sh start kafka; the first run builds the broker, about 15 minutes)"
else
  step "starting PostgreSQL and RabbitMQ (scripts/services.sh start rabbitmq)"
fi
scripts/services.sh start "$BROKER" >/dev/null || fail "scripts/services.sh could not start the services (see its messages above)"

step "building outbox-relay and the tail example (release; the first build takes up to 15 minutes)"
cargo build --release --bin outbox-relay --example tail || fail "cargo build failed"

step "database $DB on 127.0.0.1:$PG_PORT"
exists=$(psql -X -At -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres \
  -c "SELECT 1 FROM pg_database WHERE datname = '$DB'") || fail "cannot reach PostgreSQL on 127.0.0.1:$PG_PORT"
if [ "$exists" = 1 ]; then
  note "exists"
else
  psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c "CREATE DATABASE $DB" ||
    fail "cannot create database $DB"
  note "created"
fi

step "$RELAY migrate --config $CONFIG"
migrated=$("$RELAY" migrate --config "$CONFIG" 2>&1) || {
  printf '%s\n' "$migrated" | indent
  fail "outbox-relay migrate failed"
}
printf '%s\n' "$migrated" | indent

# What counts as sent: a new outbox records it by ranges (README, "Marking"), one
# relayed by update by relay_sent_at; the predicate answers for both.
if [ "$(psql_demo -At -c "SELECT to_regproc('public.outbox_relay_sent') IS NOT NULL")" = t ]; then
  SENT="public.outbox_relay_sent(relay_seq, relay_xid, relay_sent_at)"
else
  SENT="relay_sent_at IS NOT NULL"
fi

# Rows left unsent by an earlier, interrupted run are published too, and counted.
if [ "$BROKER" = kafka ]; then
  pending=$(psql_demo -At -c "SELECT count(*) FROM public.outbox WHERE NOT $SENT AND aggregate_type = 'order'")
else
  pending=$(psql_demo -At -c "SELECT count(*) FROM public.outbox WHERE NOT $SENT")
fi
[ "$pending" = 0 ] || note "$pending event(s) left unsent by an earlier run will be published too"
EVENTS=5
expect=$((pending + EVENTS))

if [ "$BROKER" = kafka ]; then
  step "consumer: topic $TOPIC on $KAFKA (created if missing), messages from now on"
  tail_args=(kafka --brokers "$KAFKA" --topic "$TOPIC")
  # The topic keeps the messages of earlier runs: --since leaves them out.
  tail_setup=(--create-topic --since "$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)")
else
  step "consumer: a queue bound to exchange $EXCHANGE (declared if missing), before anything is published"
  tail_args=(rabbitmq --url "$AMQP_URL" --exchange "$EXCHANGE")
  tail_setup=()
fi
"$TAIL" "${tail_args[@]}" "${tail_setup[@]}" --count "$expect" --timeout "${WAIT}s" >"$TAIL_OUT" 2>"$TAIL_ERR" </dev/null &
tail_pid=$!
echo "$tail_pid" >"$TAIL_PID"
wait_for_line "$TAIL_ERR" '^ready:' "$tail_pid" "consumer ready" || fail "the consumer stopped before it was ready"
grep -v '^ready:' "$TAIL_ERR" | indent || true
grep '^ready:' "$TAIL_ERR" | sed 's/^ready: //' | indent

step "starting the relay in the background (log: $RELAY_LOG)"
# Plain text in the log file: the relay colours its log unless NO_COLOR is set.
NO_COLOR=1 nohup "$RELAY" run --config "$CONFIG" >"$RELAY_LOG" 2>&1 </dev/null &
relay_pid=$!
echo "$relay_pid" >"$RELAY_PID"
wait_for_line "$RELAY_LOG" 'active: relaying events\|standby:' "$relay_pid" "relay start" ||
  fail "the relay exited at start"
if grep -q 'standby:' "$RELAY_LOG"; then
  fail "another relay is already active on database $DB (only one relays at a time); stop it and run this again"
fi
note "pid $relay_pid, active"

step "inserting $EVENTS events into public.outbox, as an application would in its own transactions"
# Two orders; events of one aggregate keep their order on the broker. The traceparent header
# (W3C trace context) travels with each message.
inserted=$(
  psql_demo -At <<'SQL'
\set trace_id `od -An -N16 -tx1 /dev/urandom | tr -d ' \n'`
\set tp '00-' :trace_id '-'
BEGIN;
INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'order-1001', 'OrderPlaced',
        '{"order_id": "order-1001", "customer_id": "c-42", "lines": [{"sku": "book-978", "qty": 2}], "total": "59.90", "currency": "EUR"}',
        jsonb_build_object('traceparent', :'tp' || '00f067aa0ba902b7-01'))
RETURNING id;
INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'order-1002', 'OrderPlaced',
        '{"order_id": "order-1002", "customer_id": "c-7", "lines": [{"sku": "mug-01", "qty": 1}], "total": "12.00", "currency": "EUR"}',
        jsonb_build_object('traceparent', :'tp' || '00f067aa0ba902b8-01'))
RETURNING id;
COMMIT;
INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'order-1001', 'OrderPaid',
        '{"order_id": "order-1001", "payment_id": "pay-5531", "amount": "59.90", "currency": "EUR"}',
        jsonb_build_object('traceparent', :'tp' || '00f067aa0ba902b9-01'))
RETURNING id;
INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'order-1002', 'OrderCancelled',
        '{"order_id": "order-1002", "reason": "customer request"}',
        jsonb_build_object('traceparent', :'tp' || '00f067aa0ba902ba-01'))
RETURNING id;
INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
VALUES (gen_random_uuid(), 'order', 'order-1001', 'OrderShipped',
        '{"order_id": "order-1001", "carrier": "DHL", "tracking": "JD0146000038"}',
        jsonb_build_object('traceparent', :'tp' || '00f067aa0ba902bb-01'))
RETURNING id;
SQL
) || fail "inserting the events failed"
mapfile -t ids < <(printf '%s\n' "$inserted" | grep -E '^[0-9a-f-]{36}$')
[ "${#ids[@]}" = "$EVENTS" ] || fail "expected $EVENTS event ids from psql, got ${#ids[@]}"
printf '%s\n' "${ids[@]}" | indent

step "waiting for the consumer to print $expect message(s)"
for ((i = 0; i < (WAIT + 10) * 10; i++)); do
  alive "$tail_pid" || break
  sleep 0.1
done
alive "$tail_pid" && fail "the consumer did not finish within $((WAIT + 10)) s"
tail_status=0
wait "$tail_pid" || tail_status=$?
rm -f "$TAIL_PID"
echo
cat "$TAIL_OUT"
[ "$tail_status" = 0 ] || fail "the consumer received fewer than $expect messages (exit status $tail_status)"
for id in "${ids[@]}"; do
  grep -q -- "$id" "$TAIL_OUT" || fail "event $id was not among the messages received"
done
alive "$relay_pid" || fail "the relay exited"

step "the rows, now marked sent by the relay"
id_list=$(printf "'%s'," "${ids[@]}")
id_list=${id_list%,}
query="SELECT relay_seq AS seq, aggregate_id, event_type, $SENT AS sent FROM public.outbox WHERE id IN ($id_list) ORDER BY relay_seq"
# The relay marks a row after the broker's confirmation, which may come a moment after
# the consumer saw the message.
for ((i = 0; i < WAIT * 10; i++)); do
  unsent=$(psql_demo -At -c "SELECT count(*) FROM public.outbox WHERE id IN ($id_list) AND NOT $SENT")
  [ "$unsent" = 0 ] && break
  sleep 0.1
done
psql_demo -c "$query" | indent
[ "$unsent" = 0 ] || fail "$unsent event(s) still not recorded as sent after $WAIT s"

printf '\n==> stopping the relay (SIGTERM)\n'
kill -TERM "$relay_pid"
for ((i = 0; i < 40 * 10; i++)); do
  alive "$relay_pid" || break
  sleep 0.1
done
alive "$relay_pid" && fail "the relay did not stop within 40 s of SIGTERM"
relay_status=0
wait "$relay_pid" || relay_status=$?
rm -f "$RELAY_PID"
[ "$relay_status" = 0 ] || fail "the relay exited with status $relay_status"
tail -n 2 "$RELAY_LOG" | indent

cat <<NEXT

Events flowed from PostgreSQL to $BROKER in $((SECONDS - started)) s. Next:
  - the configuration used:   $CONFIG  (every key is described in README.md)
  - run the relay yourself:   $RELAY run --config $CONFIG
  - watch the broker:         $TAIL ${tail_args[*]} --timeout 10m
  - insert an event:          psql -h 127.0.0.1 -p $PG_PORT -U postgres $DB -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'order', 'order-1003', 'OrderPlaced', '{}')"
  - the other broker:         $0 $([ "$BROKER" = kafka ] && echo rabbitmq || echo kafka)
  - the tests:                scripts/test.sh
NEXT
