#!/bin/bash
# Retention of N sent rows, relay.mark = "update" (rows with relay_sent_at)
# against "ranges" (rows a frontier covers), with retention.pause = 0: one
# line per run with the wall time of `outbox-relay retention --once`.
#
#   cargo build --release
#   benches/retention-ranges.sh update 100000; benches/retention-ranges.sh ranges 100000
#
# Needs a PostgreSQL 14+ server (OUTBOX_RELAY_TEST_PG, the suite's cluster
# by default); creates and drops one database per run. The frontier is
# written by hand as the fold would (every row visible, a minute old).
set -euo pipefail
mode=${1:?update or ranges}
n=${2:-100000}
pg=${OUTBOX_RELAY_TEST_PG:-postgres://postgres@127.0.0.1:55432/postgres}
root=${pg%/*}
bin=$(dirname "$0")/../target/release/outbox-relay
db=retention_bench_$$
dir=$(mktemp -d)
trap 'psql -q "$pg" -c "DROP DATABASE IF EXISTS $db" >/dev/null; rm -rf "$dir"' EXIT
psql -q "$pg" -c "CREATE DATABASE $db"
cat > "$dir/relay.toml" <<TOML
[database]
url = "$root/$db"
[relay]
mark = "$mode"
[retention]
sent_window = "0s"
pause = "0s"
batch_size = 1000
[sink]
type = "rabbitmq"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
exchange = "amq.topic"
TOML
"$bin" migrate --config "$dir/relay.toml" >/dev/null
sent_at=$([ "$mode" = update ] && echo "now() - interval '1 minute'" || echo "NULL")
psql -q "$root/$db" -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_sent_at)
    SELECT gen_random_uuid(), 'o', (g % 100)::text, 'e', jsonb_build_object('p', repeat('x', 200)), $sent_at
    FROM generate_series(1, $n) g"
if [ "$mode" = ranges ]; then
  psql -q "$root/$db" -c "INSERT INTO outbox_relay_frontier (snapshot, max_seq, folded_at)
      SELECT pg_current_snapshot(), (SELECT max(relay_seq) FROM outbox), now() - interval '1 minute'"
fi
psql -q "$root/$db" -c "VACUUM ANALYZE outbox"
start=$(date +%s.%N)
out=$("$bin" retention --once --config "$dir/relay.toml")
end=$(date +%s.%N)
left=$(psql -qtA "$root/$db" -c "SELECT count(*) FROM outbox")
echo "$mode rows=$n wall_s=$(echo "$end - $start" | bc) left=$left :: $out"
