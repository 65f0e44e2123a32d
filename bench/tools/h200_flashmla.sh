#!/usr/bin/env bash
# FlashMLA (vllm/_flashmla_C, vLLM 0.33.0's build, stable torch ABI) on the lent H200: load it on
# the image's torch, run the flashmla family's GPU tests, then sweep the default buckets with
# flashinfer + flashmla into $OUT/flashmla.db (every candidate correctness-gated).
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh &&
#               mkdir -p .ops && xz -9 -c .venv/lib/python3.11/site-packages/vllm/_flashmla_C.abi3.so > .ops/_flashmla_C.abi3.so.xz
#   there (carry .carry, .whl, .ops):  bash bench/tools/h200_flashmla.sh
set -u
source bench/tools/device-setup.sh
xz -dc .ops/_flashmla_C.abi3.so.xz > /tmp/site/vllm/_flashmla_C.abi3.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "
from vllm_metax.ops import flashmla as f
print('library:', f.library_path()); print('available:', f.flashmla_available())"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_gpu_flashmla.py > "$OUT/pytest_gpu_flashmla.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu_flashmla.txt"; tail -8 "$OUT/pytest_gpu_flashmla.txt"
/usr/bin/time -f "sweep wall %e s" timeout ${SWEEP_TIMEOUT:-330} python3 -m mla_tune sweep --family flashinfer --family flashmla \
  --db "$OUT/flashmla.db" --configs-dir "$OUT/configs" --time-budget ${SWEEP_BUDGET:-270} -q > "$OUT/flashmla_sweep.txt" 2>&1
echo "sweep rc=$?"; tail -8 "$OUT/flashmla_sweep.txt"
python3 -c "import sqlite3, sys; c=sqlite3.connect(sys.argv[1]); c.execute('pragma wal_checkpoint(truncate)')" "$OUT/flashmla.db"
python3 -m mla_tune report --db "$OUT/flashmla.db" > "$OUT/flashmla_report.txt" 2>&1; echo "report rc=$?"
