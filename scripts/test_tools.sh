#!/usr/bin/env bash
# OS tools the test suite needs beyond .venv; idempotent, a quick no-op when they are there.
#
#   chromium   a headless browser for tests/test_monitor_http.py (loads the monitor's status page)
#   nft        nftables, for the testbed's home routers (NetLab.add_nat_host masquerades with it)
#
# As root (CI, this project's machines) it installs what is missing from the Debian packages. As
# anyone else it only says what is missing; the tests that need it then skip and name the reason.
set -euo pipefail

packages=()
command -v chromium >/dev/null 2>&1 || packages+=(chromium fonts-dejavu-core)
command -v nft >/dev/null 2>&1 || packages+=(nftables)
if [ "${#packages[@]}" = 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "[tools] missing: ${packages[*]}; the tests that need them will skip (install: sudo apt-get install ${packages[*]})" >&2
    exit 0
fi

log="${TMPDIR:-/tmp}/swarm-test-tools.log"
echo "[tools] installing ${packages[*]} from the Debian packages (log: $log)"
export DEBIAN_FRONTEND=noninteractive
install() {
    apt-get install -y --no-install-recommends "${packages[@]}" >>"$log" 2>&1
}
: >"$log"
# A stale package list makes the download fail: refresh it once and try again.
if ! install && ! { apt-get update >>"$log" 2>&1 && install; }; then
    echo "[tools] apt-get install ${packages[*]} failed; the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
fi
echo "[tools] done ($(chromium --version 2>/dev/null || echo 'chromium installed'); $(nft --version 2>/dev/null || echo 'nft installed'))"
