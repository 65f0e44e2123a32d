#!/usr/bin/env bash
# Tune the MLA prefill backend on the lent GPU (issue #12): the GPU prefill tests (the tuner's
# flashinfer_prefill candidates and the plugin's tuned prefill plans on the real kernel), then
# `mla-tune prefill-sweep` into results.db (the default buckets: DeepSeek-V3 TP1 and TP8, fa2 and
# fa3; every sample stored) and `mla-tune emit` of the config with its prefill sections.
# Results in $OUT: pytest_gpu_prefill.txt, prefill_sweep.txt, results.db, configs/, emit.txt.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/h200_prefill_sweep.sh
set -u
start=$(date +%s)
source bench/device-setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== pytest tests/test_gpu_prefill.py"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_gpu_prefill.py \
  > "$OUT/pytest_gpu_prefill.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu_prefill.txt"
grep -E "passed|failed|FAILED|Error|rc=" "$OUT/pytest_gpu_prefill.txt" | tail -12
echo "== prefill-sweep ($(( $(date +%s) - start )) s in)"
/usr/bin/time -f "prefill-sweep wall %e s" timeout ${PREFILL_SWEEP_TIMEOUT:-420} \
  python3 -m mla_tune prefill-sweep --db results.db "$@" > "$OUT/prefill_sweep.txt" 2>&1
echo "prefill-sweep rc=$?" >> "$OUT/prefill_sweep.txt"
tail -6 "$OUT/prefill_sweep.txt"
python3 -c "import sqlite3; c=sqlite3.connect('results.db'); c.execute('pragma wal_checkpoint(truncate)')"
cp results.db "$OUT/results.db"
echo "== emit"
python3 -m mla_tune emit --db results.db --out "$OUT/configs" > "$OUT/emit.txt" 2>&1
echo "emit rc=$?" >> "$OUT/emit.txt"
cat "$OUT/emit.txt"
echo "done in $(( $(date +%s) - start )) s"
