#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not multipeer" -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
echo "[test] ruff check + format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] pytest"
.venv/bin/python -m pytest "$@"
