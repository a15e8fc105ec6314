#!/usr/bin/env bash
# Idempotent setup: creates .venv at the repo root and installs the project with its dev extra.
# A second run with nothing changed is a quick no-op (it compares a stamp of pyproject.toml).
# SWARM_TORCH_SPEC overrides the torch requirement, e.g. SWARM_TORCH_SPEC="torch==2.5.1" for a CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
torch_spec="${SWARM_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.swarm-setup-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $torch_spec"

# Byte-compile the project (a quick no-op when nothing changed). Where PYTHONDONTWRITEBYTECODE is set,
# as in many containers, nothing is ever cached otherwise, and every peer process a local swarm or the
# tests start would compile swarm/ and peers/ again: about a second of CPU each.
compile_project() {
    "$venv/bin/python" -m compileall -q swarm peers testbed tests scripts >/dev/null
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/swarm" ]; then
    compile_project
    exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv"
    python3 -m venv "$venv"
fi
log="$venv/setup.log"
echo "[setup] installing $torch_spec and the project with its dev extra (log: $log)"
install() {
    if ! "$venv/bin/python" -m pip install --quiet "$@" >>"$log" 2>&1; then
        echo "[setup] pip install $* failed; the end of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}
: >"$log"
install --upgrade pip
install "$torch_spec"
install -e ".[dev]"
compile_project
echo "$want" > "$stamp"
echo "[setup] done"
