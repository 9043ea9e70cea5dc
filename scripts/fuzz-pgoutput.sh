#!/usr/bin/env bash
# Fuzzes the pgoutput decoder for a bounded time, seeded with the captured fixtures.
#
#   scripts/fuzz-pgoutput.sh [seconds]      (default 60)
#
# A crash leaves its input in fuzz/artifacts/pgoutput/ and makes this script fail; replay it
# with `RUSTC_BOOTSTRAP=1 cargo fuzz run pgoutput fuzz/artifacts/pgoutput/<file>`.
set -euo pipefail

seconds="${1:-60}"
case "$seconds" in
    '' | *[!0-9]*)
        echo "usage: $0 [seconds]" >&2
        exit 2
        ;;
esac

cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

# cargo-fuzz builds with -Z flags (sanitizer, coverage instrumentation) that only a nightly
# compiler accepts; RUSTC_BOOTSTRAP=1 makes the stable toolchain accept them, since no nightly
# can be installed here.
export RUSTC_BOOTSTRAP=1

corpus=fuzz/corpus/pgoutput
mkdir -p "$corpus"
# One seed per captured message: fixture lines are `lsn|xid|hex`.
for fixture in tests/fixtures/pgoutput/*.hex; do
    name="$(basename "$fixture" .hex)"
    line=0
    while IFS='|' read -r _lsn _xid hex; do
        line=$((line + 1))
        # Only \xHH escapes reach printf's format, so it writes exactly those bytes.
        # shellcheck disable=SC2059
        printf "$(printf '%s' "$hex" | sed 's/../\\x&/g')" >"$corpus/seed-$name-$line"
    done <"$fixture"
done

cargo fuzz run pgoutput "$corpus" -- -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048
