#!/usr/bin/env bash
# One device call that verifies and measures everything GPU-side, in priority order, inside a
# fixed wall-clock allowance: GPU tests, then the DeepSeek-V3 TP1+TP8 sweep with what time is
# left, then the per-step plan cost. Usage on the device machine (carry .carry and .whl):
#   bash bench/h200_final.sh [total_seconds]
set -u
total=${1:-540}
start=$(date +%s)
left() { echo $(( total - ($(date +%s) - start) )); }
source .carry/device-env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site2 VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

echo "== pytest -m gpu ($(left) s left)"
timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tail -40 > "$OUT/pytest_gpu.txt"
tail -5 "$OUT/pytest_gpu.txt"

budget=$(( $(left) - 75 ))
echo "== sweep, time budget ${budget} s"
rm -f results.db results.db-wal results.db-shm results.optuna.log
timeout $(( budget + 45 )) python3 -m mla_tune sweep --db results.db --model deepseek-v3 --tp 1 --tp 8 \
  --time-budget "$budget" 2>&1 | tee "$OUT/sweep.txt" | tail -25
cp results.db "$OUT/results.db"; cp results.optuna.log "$OUT/" 2>/dev/null
cp configs/device_name=NVIDIA_H200.json "$OUT/" 2>/dev/null

echo "== plan cost ($(left) s left)"
[ "$(left)" -gt 25 ] && timeout $(( $(left) - 5 )) python3 bench/plan_cost.py --out "$OUT" 2>&1 | tail -20 > "$OUT/plan_cost.txt"
echo "done in $(( $(date +%s) - start )) s"
