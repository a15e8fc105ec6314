#!/usr/bin/env bash
# One prepared check of the GPU path, for a machine with a CUDA GPU (at most ~8 minutes):
#
#   1. runs the tests that need CUDA (every test named *cuda*; they skip without a GPU);
#   2. trains a 2-peer swarm of gpt-125m on the one GPU for a fixed number of steps (`swarm local`,
#      on the standard library's source, so nothing is downloaded);
#   3. writes a JSON (default gpu_check.json, or $1) with, per peer: tokens/s, MFU, peak memory
#      against the estimate at the micro-batch it chose, and the precision and optimizer chosen.
#
# Usage: scripts/gpu_check.sh [OUT.json]      (PYTHON=... to pick the interpreter)
# Exits 2 with a message when no CUDA GPU is present, 1 when a step fails; the project never needs it.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-gpu_check.json}"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false, or torch is missing for $PYTHON);" \
    "this check needs one and tests nothing without it" >&2
  exit 2
fi
"$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__}")'

WORK="${OUT%.json}.logs"  # the tests' and the peers' logs, kept for a look after a failure
rm -rf "$WORK" && mkdir -p "$WORK"

# ---------------------------------------------------------------- 1. the CUDA tests (<= 3 minutes)
TESTS_RC=0
timeout 180 "$PYTHON" -m pytest -n 0 -q -p no:cacheprovider -k cuda -m "not multipeer" \
  tests/test_learning_device.py tests/test_learning_inner.py tests/test_learning_model.py \
  tests/test_learning_outer.py tests/test_estimate.py 2>&1 | tee "$WORK/tests.log" | tail -n 15 || TESTS_RC=$?
TESTS_TAIL="$(tail -n 1 "$WORK/tests.log")"

# ---------------------------------------------------------------- 2. a 2-peer gpt-125m swarm (<= 4 minutes)
STEPS=60
SETS=(
  --set data.source=stdlib
  --set run.target_samples=null
  --set train.device=cuda
  --set train.batch_size=16
  --set "train.max_steps=$STEPS"
  --set train.eval_batches=1
  --set averaging.sync_every_steps=20
  --set averaging.sync_every_seconds=60
  --set averaging.outer_state_device=device
  --set network.record_interval_s=2
  --set network.record_ttl_s=8
)
SWARM_RC=0
timeout 270 "$PYTHON" -m peers.cli local --peers 2 --config configs/gpt-125m.yaml --duration 240 \
  --log-dir "$WORK/logs" --summary "$WORK/summary.json" "${SETS[@]}" >"$WORK/local.log" 2>&1 || SWARM_RC=$?
tail -n 5 "$WORK/local.log"

# ---------------------------------------------------------------- 3. the JSON
"$PYTHON" scripts/gpu_check_report.py --work "$WORK" --out "$OUT" --tests-rc "$TESTS_RC" \
  --tests-result "$TESTS_TAIL" --swarm-rc "$SWARM_RC" --steps "$STEPS" -- "${SETS[@]}"
