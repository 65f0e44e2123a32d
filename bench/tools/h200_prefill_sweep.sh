#!/usr/bin/env bash
# Tune the MLA prefill backend on the lent GPU (issue #12): the GPU prefill tests (the tuner's
# flashinfer_prefill candidates and the plugin's tuned prefill plans on the real kernel), then
# `mla-tune prefill-sweep` into results.db (the default buckets: DeepSeek-V3 TP1 and TP8, fa2 and
# fa3; every sample stored) and `mla-tune emit` of the config with its prefill sections.
# Results in $OUT: pytest_gpu_prefill.txt, prefill_sweep.txt, results.db, configs/, emit.txt.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_prefill_sweep.sh
# The whole call stays within BUDGET_S (default 570 s, under the device's 10-minute command
# limit): the sweep gets what the tests left. It sweeps into a copy of the repository's results.db
# kept outside the working tree (PREFILL_DB), which a second call on the still-warm machine
# resumes (SKIP_TESTS=1 skips the tests then).
set -u
start=$(date +%s)
source bench/tools/device-setup.sh
DB=${PREFILL_DB:-/tmp/mla_prefill/results.db}
[ -f "$DB" ] || { mkdir -p "$(dirname "$DB")" && cp results.db "$DB"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== pytest tests/test_gpu_prefill.py"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_gpu_prefill.py \
    > "$OUT/pytest_gpu_prefill.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu_prefill.txt"
  grep -E "passed|failed|FAILED|Error|rc=" "$OUT/pytest_gpu_prefill.txt" | tail -12
fi
left=$(( ${BUDGET_S:-570} - ($(date +%s) - start) - 40 ))   # 40 s kept for the copy and emit
echo "== prefill-sweep ($(( $(date +%s) - start )) s in, ${left} s for it)"
/usr/bin/time -f "prefill-sweep wall %e s" timeout $(( left > 30 ? left : 30 )) \
  python3 -m mla_tune prefill-sweep --db "$DB" "$@" > "$OUT/prefill_sweep.txt" 2>&1
echo "prefill-sweep rc=$?" >> "$OUT/prefill_sweep.txt"
tail -6 "$OUT/prefill_sweep.txt"
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('pragma wal_checkpoint(truncate)')" "$DB"
cp "$DB" "$OUT/results.db"
echo "== emit"
python3 -m mla_tune emit --db "$DB" --out "$OUT/configs" > "$OUT/emit.txt" 2>&1
echo "emit rc=$?" >> "$OUT/emit.txt"
cat "$OUT/emit.txt"
echo "done in $(( $(date +%s) - start )) s"
