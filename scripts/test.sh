#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, type-check, then run the whole test suite.
#
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh --fast          the inner-loop tier: skips the multi-process tests (-m "not multipeer")
#   scripts/test.sh --under-load    the same run while a CPU burner keeps every core busy, to check that
#                                   no test depends on the machine being fast (or idle)
#
# Every other argument goes to pytest, e.g. scripts/test.sh --fast -x -k gossip. pytest always prints
# the 25 slowest tests (--durations=25; pass your own --durations=N to change it). Tests run in one
# pytest-xdist worker per core (-n auto --dist loadgroup: the heavy swarm scenarios share one worker,
# so at most one runs at a time); pass -n 0 to run them in this process, one after another (e.g. for
# a debugger or -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

fast=0
under_load=0
pytest_args=()
for arg in "$@"; do
    case "$arg" in
        --fast) fast=1 ;;
        --under-load) under_load=1 ;;
        *) pytest_args+=("$arg") ;;
    esac
done

bash scripts/setup.sh
bash scripts/test_tools.sh   # OS packages some tests use (chromium); installs them as root
echo "[test] ruff check + format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] mypy (swarm/ and peers/, configured in pyproject.toml)"
.venv/bin/mypy

burners=()
stop_burners() {
    if [ "${#burners[@]}" -gt 0 ]; then
        kill "${burners[@]}" 2>/dev/null || true
        wait "${burners[@]}" 2>/dev/null || true
        burners=()
    fi
}
# Whatever ends the script (pytest failing, Ctrl+C, SIGTERM), the burners stop with it.
trap stop_burners EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ "$under_load" = 1 ]; then
    cores="$(nproc)"
    # One busy Python loop per core. Each also ends by itself once this script is gone (its parent
    # changes), so not even a SIGKILLed run leaves one spinning.
    burn='import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass'
    for _ in $(seq "$cores"); do
        .venv/bin/python -c "$burn" &
        burners+=("$!")
    done
    echo "[test] under load: ${#burners[@]} CPU burner(s) running (pids ${burners[*]})"
fi

# One torch thread per process unless you say otherwise: two xdist workers and the peers they start
# already keep every core busy, and torch's default (a thread per core in every process)
# oversubscribes them, which made the heavy scenarios ~15% slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

selection=()
if [ "$fast" = 1 ]; then
    selection=(-m "not multipeer")
fi
echo "[test] pytest${selection[*]:+ ${selection[*]}}"
started=$SECONDS
status=0
.venv/bin/python -m pytest -n auto --dist loadgroup --durations=25 "${selection[@]}" "${pytest_args[@]}" || status=$?
echo "[test] pytest exited $status after $((SECONDS - started)) s"
exit "$status"
