#!/usr/bin/env bash
# The test command (README, .ci/run): starts the services the suite needs,
# installing what is missing, then checks formatting and lints and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

while IFS= read -r line; do export "$line"; done < <(scripts/services.sh start)

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --no-fail-fast --failure-output final "$@"
else
  cargo test --locked --no-fail-fast "$@"
fi
