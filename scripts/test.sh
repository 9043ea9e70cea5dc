#!/usr/bin/env bash
# The test command (README, .ci/run): starts the services the suite needs,
# installing what is missing, then checks formatting and lints and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

while IFS= read -r line; do export "$line"; done < <(scripts/services.sh start)
# One cluster per other supported PostgreSQL major (tests/relay/versions.rs).
# Process substitution would hide a failure, so the output goes through a variable.
versions=$(scripts/pg-versions.sh start)
while IFS= read -r line; do export "$line"; done <<<"$versions"

# Databases and replication slots left by an interrupted earlier run would keep WAL.
for url in "$OUTBOX_RELAY_TEST_PG" $(printf '%s\n' "$versions" | cut -d= -f2-); do
  psql "$url" -qAt -v ON_ERROR_STOP=0 >/dev/null 2>&1 <<'SQL' || true
SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname LIKE 't\_%';
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'slot\_%';
SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', datname) FROM pg_database WHERE datname LIKE 't\_%' \gexec
SQL
done

# The tools that check the deployment files (tests/deploy/); a missing one fails its test.
scripts/deploy-checks.sh install

cargo fmt --all -- --check
cargo clippy --all-targets --locked --features failpoints -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --features failpoints --no-fail-fast --failure-output final "$@"
else
  cargo test --locked --features failpoints --no-fail-fast "$@"
fi
