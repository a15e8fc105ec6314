#!/usr/bin/env bash
# One command for a volunteer: scripts/join.sh <INITIAL_PEER> [swarm join options]
#
# Sets up .venv (scripts/setup.sh --volunteer: no dev tools; a no-op when it is ready), keeps this
# machine's identity in $SWARM_HOME/identity.key (default ~/.swarm) so the peer id survives restarts,
# detects the device, fetches the swarm's run config (unless you pass --config), and trains with checkpoints in
# $SWARM_HOME/checkpoints, resuming from them when you run it again. Ctrl+C stops cleanly (a checkpoint
# is saved). The micro-batch is sized to the GPU's memory by the trainer itself.
set -euo pipefail

usage() {
    echo "usage: $0 <INITIAL_PEER> [swarm join options]" >&2
    echo "  INITIAL_PEER: the address after 'swarm join --initial-peers' that the organizer published" >&2
}
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    usage
    exit 2
fi
initial_peer="$1"
shift

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
home="${SWARM_HOME:-$HOME/.swarm}"
mkdir -p "$home/checkpoints" "$home/logs"
chmod 700 "$home"

"$root/scripts/setup.sh" --volunteer   # no dev tools: the project and what a run may need (hf)
swarm="$root/.venv/bin/swarm"

given() {  # given OPTION ARGS...: whether the user passed OPTION (as "OPTION" or "OPTION=...")
    local option="$1"
    shift
    for arg in "$@"; do
        if [ "$arg" = "$option" ] || [[ "$arg" == "$option="* ]]; then
            return 0
        fi
    done
    return 1
}

device="CPU ($(nproc) cores)"
if command -v nvidia-smi >/dev/null 2>&1; then
    gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1 || true)"
    if [ -n "$gpu" ]; then
        device="GPU: $gpu"
    fi
fi
echo "[join] device: $device"

args=(--initial-peers "$initial_peer")
if ! given --config "$@" && ! given -c "$@"; then
    "$swarm" config pull --initial-peers "$initial_peer" -o "$home/run.yaml"
    args+=(--config "$home/run.yaml")
fi
if ! given --identity-path "$@"; then
    args+=(--identity-path "$home/identity.key")
fi
args+=(--set "train.checkpoint_dir=$home/checkpoints")
if compgen -G "$home/checkpoints/ckpt-*.pt" >/dev/null && ! given --resume "$@"; then
    args+=(--resume)
    echo "[join] resuming from the checkpoints in $home/checkpoints"
fi
if ! given --history "$@"; then
    args+=(--history "$home/history.jsonl")
fi

log="$home/logs/join-$(date +%Y%m%d-%H%M%S).log"
echo "[join] identity: $home/identity.key; checkpoints: $home/checkpoints"
echo "[join] log: $log; per-sync history: $home/history.jsonl (plot: swarm monitor plot)"
echo "[join] stop with Ctrl+C (saves a checkpoint); run this command again to resume"
# tee ignores Ctrl+C so that it still records the trainer's last lines while it shuts down.
exec > >(trap '' INT TERM && exec tee -a "$log") 2>&1
exec "$swarm" join "${args[@]}" "$@"
