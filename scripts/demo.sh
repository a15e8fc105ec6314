#!/usr/bin/env bash
# The README's demo: set up (idempotent), then run a local swarm on the demo config.
# Extra arguments go to `swarm local`, e.g. scripts/demo.sh --peers 4 --duration 120
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/swarm local --config configs/local-tiny.yaml "$@"
