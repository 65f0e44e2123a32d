#!/usr/bin/env bash
# One device call that measures and verifies everything GPU-side inside a fixed wall-clock
# allowance, in priority order: the DeepSeek-V3 TP1+TP8 sweep (every candidate correctness-gated
# through the real kernels), then `pytest -m gpu`, then the per-step plan cost.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_final.sh [total_seconds]
# SWEEP_ARGS overrides the bucket grid (default: the CLI's defaults); SWEEP_BUDGET the sweep's
# seconds (default 55% of the total). The full default grid (96 buckets, ~2,400 trials at the
# 5.8 trials/s measured on 2026-12-02) wants about 8 minutes: `SWEEP_BUDGET=480 bash bench/tools/h200_final.sh 590`.
TOTAL_S=${1:-540} source bench/tools/call-clock.sh   # set -u; start, total, left
source bench/tools/device-setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv

budget=${SWEEP_BUDGET:-$(( total * 55 / 100 ))}
echo "== sweep, time budget ${budget} s"
rm -f results.db results.db-wal results.db-shm results.optuna.log
/usr/bin/time -f "sweep wall %e s" timeout $(( budget + 60 )) python3 -m mla_tune sweep --db results.db \
  --model deepseek-v3 --tp 1 --tp 8 ${SWEEP_ARGS:-} --time-budget "$budget" > "$OUT/sweep.txt" 2>&1
tail -30 "$OUT/sweep.txt"
python3 -c "import sqlite3; c=sqlite3.connect('results.db'); c.execute('pragma wal_checkpoint(truncate)')"
cp results.db "$OUT/results.db"; cp results.optuna.log "$OUT/" 2>/dev/null
cp configs/device_name=NVIDIA_H200.json "$OUT/" 2>/dev/null

if [ "$(left)" -lt 90 ]; then echo "sweep only: $(left) s left, no time for pytest -m gpu and plan cost"; exit 0; fi
echo "== pytest -m gpu ($(left) s left)"
timeout $(( $(left) - 40 )) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
tail -4 "$OUT/pytest_gpu.txt"

echo "== plan cost ($(left) s left)"
[ "$(left)" -gt 20 ] && timeout $(( $(left) - 3 )) python3 bench/plan_cost.py --out "$OUT" > "$OUT/plan_cost.txt" 2>&1
tail -3 "$OUT/plan_cost.txt"
echo "done in $(( $(date +%s) - start )) s"
