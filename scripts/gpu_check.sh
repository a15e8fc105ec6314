#!/usr/bin/env bash
# The check of the GPU path, for a machine with one CUDA GPU and no network (at most ~8 minutes):
#
#   0. installs gpu-wheels/ (scripts/gpu_prepare.sh fills it where registries are reachable) with
#      `pip install --no-index` into a venv that sees the image's own torch and transformers;
#   1. runs every test named *cuda* (none may skip);
#   2. llama-1b in the host layout, the allocator capped at 12 GiB: inner steps, an int8 round through
#      the real codec with error feedback, an evaluation (scripts/_gpu_steps.py);
#   3. llama-1b in the device layout, uncapped (the outer state and the bitsandbytes codec on the GPU);
#   4. two gpt-125m peers exchanging (`swarm local`, until each committed an exchange): bf16 with the
#      state on the GPU, then fp16 with the state on the host (the dry run: the first only);
#   5. the verdict (scripts/gpu_check_report.py): tok/s, MFU, peak memory against the estimate, the
#      card's footprint, host RSS and pinned bytes; FAILS (exit 1) when no exchange committed, when
#      8-bit AdamW is not in use, when a peak leaves 0.8-1.15 of its estimate, or when the 12 GiB
#      run's footprint exceeds 12 GiB.
#
# Usage: scripts/gpu_check.sh [--dry-run] [OUT.json]
#   --dry-run: the same steps on the CPU at tiny sizes (the test suite runs it); conditions that need
#   CUDA are reported as not applicable. PYTHON=... picks the interpreter (default: the image's
#   python3 for the real run, .venv/bin/python for the dry run).
set -euo pipefail

cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:-gpu_check.json}"
WORK="${OUT%.json}.logs"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if (( DRY )); then
  PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
  INSTALL="not applicable (dry run: the interpreter already has the dependencies)"
else
  BASE="${PYTHON:-python3}"
  if ! "$BASE" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here; run scripts/gpu_check.sh --dry-run on a CPU" >&2
    exit 2
  fi
  if [[ ! -d gpu-wheels ]]; then
    echo "gpu_check: gpu-wheels/ is missing: run scripts/gpu_prepare.sh where registries are reachable" >&2
    exit 2
  fi
  VENV=/tmp/swarm-gpu-venv
  "$BASE" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links gpu-wheels gpu-wheels/*.whl
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null \
    || echo "gpu_check: the project is used from PYTHONPATH (not installed)"
  PYTHON="$VENV/bin/python"
  INSTALL="installed $(ls gpu-wheels/*.whl | wc -l) wheels (bitsandbytes CUDA: $("$PYTHON" -m scripts._gpu_wheels bnb-cuda gpu-wheels))"
  "$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__} (CUDA {torch.version.cuda})")'
fi
echo "gpu_check: $INSTALL"

# ---------------------------------------------------------------- 1. every CUDA test (<= 105 s)
TESTS=(tests/test_learning_device.py tests/test_learning_inner.py tests/test_learning_model.py
  tests/test_learning_outer.py tests/test_estimate.py tests/test_compression.py tests/test_learning_autocast.py)
TESTS_RC=0
if (( DRY )); then  # the CUDA tests skip here: collecting them shows they are there
  "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only -k cuda "${TESTS[@]}" >"$WORK/tests.log" 2>&1 || TESTS_RC=$?
else
  timeout 105 "$PYTHON" -m pytest -n 0 -q -rs -p no:cacheprovider -k cuda -m "not multipeer" "${TESTS[@]}" \
    >"$WORK/tests.log" 2>&1 || TESTS_RC=$?
fi
tail -n 3 "$WORK/tests.log"

# ---------------------------------------------------------------- 2-3. llama-1b, host and device layouts
LLAMA=()
GPT=(--set train.batch_size=8 --set averaging.sync_every_steps=10)
SWARMS=("bf16 device" "fp16 host")
STEP_TIMEOUT=90  # each of the four steps below: with the install and the tests, 8 minutes at most
if (( DRY )); then
  LLAMA=(--cpu --set model.block_size=32 --set model.hf_config.num_hidden_layers=2
    --set model.hf_config.hidden_size=64 --set model.hf_config.intermediate_size=128
    --set model.hf_config.num_attention_heads=4 --set model.hf_config.num_key_value_heads=2
    --set model.hf_config.max_position_embeddings=32 --set train.batch_size=2)
  GPT=(--set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 --set model.block_size=16
    --set train.batch_size=2 --set averaging.sync_every_steps=3 --set train.device=cpu
    --set emulation.step_time_s=0.2)  # paced: a tiny step would leave the exchanges no CPU
  SWARMS=("bf16 device")  # one swarm: the second runs the same code on the CPU
fi
MEM_RC=0
timeout "$STEP_TIMEOUT" "$PYTHON" -m scripts._gpu_steps --config configs/llama-1b.yaml --layout host \
  --cap-gib 12 --steps 3 --set compression.error_feedback=true "${LLAMA[@]}" --out "$WORK/llama-host.json" \
  >"$WORK/llama-host.log" 2>&1 || MEM_RC=$?
timeout "$STEP_TIMEOUT" "$PYTHON" -m scripts._gpu_steps --config configs/llama-1b.yaml --layout device \
  --steps 3 "${LLAMA[@]}" --out "$WORK/llama-device.json" >"$WORK/llama-device.log" 2>&1 || MEM_RC=$?

# ---------------------------------------------------------------- 4. two gpt-125m peers, twice
# each run ends once both trainers committed an exchange (scripts/_gpu_swarm.py), at the latest after
# STEP_TIMEOUT less the graceful stop
SWARM_RC=0
RAN=()
for run in "${SWARMS[@]}"; do
  read -r precision layout <<<"$run"
  RAN+=("gpt-$precision")
  sets=(--set data.source=stdlib --set run.target_samples=null --set train.eval_batches=1
    --set averaging.sync_every_seconds=60 --set network.record_interval_s=1 --set network.record_ttl_s=4
    --set "averaging.outer_state_device=$layout" "${GPT[@]}")
  (( DRY )) || sets+=(--set train.device=cuda --set "train.precision=$precision")
  timeout "$STEP_TIMEOUT" "$PYTHON" -m scripts._gpu_swarm --config configs/gpt-125m.yaml \
    --timeout $((STEP_TIMEOUT - 30)) --log-dir "$WORK/gpt-$precision" --summary "$WORK/gpt-$precision.json" \
    "${sets[@]}" >"$WORK/gpt-$precision.log" 2>&1 || SWARM_RC=$?
done

# ---------------------------------------------------------------- 5. the verdict
VERDICT=(--work "$WORK" --out "$OUT" --tests-rc "$TESTS_RC" --memory-rc "$MEM_RC" --swarm-rc "$SWARM_RC"
  --swarms "${RAN[@]}")
(( DRY )) && VERDICT+=(--dry-run)
"$PYTHON" -m scripts.gpu_check_report "${VERDICT[@]}" --install "$INSTALL"
