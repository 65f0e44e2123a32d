#!/usr/bin/env bash
# One device call after a change to the kernel path: the per-step plan cost on a quiet host
# (bench/plan_cost.py --profile), then `pytest -m gpu`. With RESUME_SWEEP=1, between the two, the
# DeepSeek-V3 TP1+TP8 sweep in results.db is resumed with no time budget (only buckets a budget cut
# short are measured; everything stored is reused) and results.db comes back in $OUT.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  [RESUME_SWEEP=1] bash bench/tools/h200_verify.sh
set -u
start=$(date +%s)
source bench/tools/device-setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== plan cost"
timeout 150 python3 bench/plan_cost.py --profile --out "$OUT" > "$OUT/plan_cost.txt" 2>&1
echo "plan_cost rc=$?"; grep -E "^- |build_decode" "$OUT/plan_cost.md" | grep -v cProfile | head -20
if [ "${RESUME_SWEEP:-0}" = 1 ]; then
  echo "== sweep resume ($(( $(date +%s) - start )) s in)"
  /usr/bin/time -f "resume wall %e s" timeout 200 python3 -m mla_tune sweep --db results.db \
    --model deepseek-v3 --tp 1 --tp 8 --time-budget 0 > "$OUT/sweep_resume.txt" 2>&1
  tail -14 "$OUT/sweep_resume.txt"
  python3 -c "import sqlite3; c=sqlite3.connect('results.db'); c.execute('pragma wal_checkpoint(truncate)')"
  cp results.db "$OUT/results.db"; cp results.optuna.log "$OUT/"
fi
echo "== pytest -m gpu ($(( $(date +%s) - start )) s in)"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
grep -E "passed|failed|FAILED|Error|rc=" "$OUT/pytest_gpu.txt" | tail -12
echo "done in $(( $(date +%s) - start )) s"
