#!/usr/bin/env bash
# Is the MLA prefill backend (fa2/fa3) or vLLM's chunked-prefill workspace size a real choice on this GPU? Runs bench/experiments/prefill_choice.py (~3 min with JIT) after `source .carry/device-env.sh`; results in $OUT.
set -u
if ! python3 -c "import flashinfer" 2>/dev/null; then source .carry/device-env.sh; fi
export VLLM_METAX_FORCE=1      # vLLM's compiled ops are not carried: the project's platform must be the active one
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  | tee "$OUT/nvidia-smi.txt"
timeout ${PREFILL_TIMEOUT:-420} python3 bench/experiments/prefill_choice.py --out "$OUT" "$@" 2>&1 | tee "$OUT/prefill_choice.log"
echo "prefill_choice rc=${PIPESTATUS[0]}"
