#!/usr/bin/env bash
# Idempotent setup: creates .venv at the repo root and installs the project.
#
#   scripts/setup.sh               the project with its dev extra (tests, linters, TensorBoard): what
#                                  scripts/test.sh and scripts/demo.sh use
#   scripts/setup.sh --volunteer   (or SWARM_SETUP=volunteer) only what a peer needs to train: the project
#                                  and its hf extra, no dev tools; what scripts/join.sh uses
#
# A second run with nothing changed is a quick no-op (it compares a stamp of pyproject.toml, the torch
# requirement and the kind of install; a dev install also serves a volunteer). pip's progress is shown
# as it goes, its whole output is kept in .venv/setup.log.
# SWARM_TORCH_SPEC overrides the torch requirement, e.g. SWARM_TORCH_SPEC="torch==2.5.1" for a CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

kind="${SWARM_SETUP:-dev}"
for arg in "$@"; do
    case "$arg" in
        --volunteer) kind=volunteer ;;
        --dev) kind=dev ;;
        *) echo "usage: $0 [--volunteer | --dev]" >&2; exit 2 ;;
    esac
done
case "$kind" in
    dev) extras="dev" ;;
    volunteer) extras="hf" ;;
    *) echo "[setup] SWARM_SETUP must be 'dev' or 'volunteer', not '$kind'" >&2; exit 2 ;;
esac

venv="$root/.venv"
torch_spec="${SWARM_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.swarm-setup-stamp"
base="$(sha256sum pyproject.toml | cut -d' ' -f1) $torch_spec"
want="$base $kind"

# Byte-compile the project (a quick no-op when nothing changed). Where PYTHONDONTWRITEBYTECODE is set,
# as in many containers, nothing is ever cached otherwise, and every peer process a local swarm or the
# tests start would compile swarm/ and peers/ again: about a second of CPU each.
compile_project() {
    "$venv/bin/python" -m compileall -q swarm peers testbed tests scripts >/dev/null
}

ready() {  # whether the venv already holds this install (a dev install holds a volunteer's too)
    [ -f "$stamp" ] && [ -x "$venv/bin/swarm" ] || return 1
    local have
    have="$(cat "$stamp")"
    if [ "$have" = "$base" ]; then  # a stamp written before installs had kinds: a dev install
        have="$base dev"
    fi
    [ "$have" = "$want" ] || { [ "$kind" = volunteer ] && [ "$have" = "$base dev" ]; }
}

if ready; then
    compile_project
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv"
    python3 -m venv "$venv"
fi
log="$venv/setup.log"
echo "[setup] installing $torch_spec and the project with its $extras extra ($kind install; full log: $log)"

pip_pid=""
stop_pip() {
    if [ -n "$pip_pid" ]; then
        kill "$pip_pid" 2>/dev/null || true
    fi
}
trap stop_pip EXIT

# install WHAT PIP-ARGS...: run pip in the background and show its progress: its latest step as soon as
# it changes (at most every 5 s), and every 15 s that it is still working, so a long step (unpacking
# torch) is never silence. pip ignores Ctrl+C there (a background job), so the EXIT trap stops it.
install() {
    local what="$1"
    shift
    echo "[setup] pip: $what"
    "$venv/bin/python" -m pip install --progress-bar off "$@" >>"$log" 2>&1 &
    pip_pid=$!
    local waited=0 shown="" latest
    while kill -0 "$pip_pid" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if [ $((waited % 5)) -ne 0 ]; then
            continue
        fi
        latest="$(grep -E '^ *(Collecting|Downloading|Building|Installing collected|Successfully)' "$log" \
            | tail -n 1 | cut -c1-100 || true)"
        if [ -n "$latest" ] && [ "$latest" != "$shown" ]; then
            echo "[setup]   ${waited}s: ${latest#"${latest%%[! ]*}"}"
            shown="$latest"
        elif [ $((waited % 15)) -eq 0 ]; then
            echo "[setup]   ${waited}s: still working"
        fi
    done
    if ! wait "$pip_pid"; then
        pip_pid=""
        echo "[setup] pip install $* failed; the end of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    pip_pid=""
    echo "[setup]   done in ${waited}s"
}
: >"$log"
install "upgrading pip" --upgrade pip
install "$torch_spec" "$torch_spec"
install "the project (.[$extras])" -e ".[$extras]"
compile_project
echo "$want" > "$stamp"
echo "[setup] done: the swarm command is $venv/bin/swarm; to type just 'swarm', run: source .venv/bin/activate"
