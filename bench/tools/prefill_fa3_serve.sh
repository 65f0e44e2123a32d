#!/usr/bin/env bash
# One device call (carry .dev .fa3 .fijit): the prefill sweep with vLLM's FA3 varlen prefill
# (vllm_fa3) beside FlashInfer's fa2/fa3 into $OUT/prefill_sweep.db, its per-bucket table, the GPU
# prefill tests, the packaged config for this GPU with its prefill sections re-chosen from that
# sweep (/tmp/tuned_pf, only where the tests passed; bench/tools/with_prefill.py), then
# serve_device_run.sh with that config (MODELS, SETUPS, SERVE_ARGS as there) in what is left of
# TOTAL_S (default 585 s).
set -u
start=$(date +%s); total=${TOTAL_S:-585}
source bench/tools/serve-env.sh >/dev/null 2>&1 || exit 3
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
timeout 150 python3 -m mla_tune prefill-sweep --db $OUT/prefill_sweep.db > $OUT/prefill_sweep.txt 2>&1
echo "prefill-sweep rc=$? ($(( $(date +%s) - start )) s)"
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('pragma wal_checkpoint(truncate)')" $OUT/prefill_sweep.db
# bucket | fa3 | fa2 | vllm_fa3 | fa3 / vllm_fa3
awk -F'  +' '/^H[0-9]+ /{split($2, c, "/"); t[$1, c[2]] = $3 + 0; if (!seen[$1]++) order[++n] = $1}
  END {for (i = 1; i <= n; i++) {b = order[i]; r = t[b, "vllm_fa3"] ? t[b, "fa3"] / t[b, "vllm_fa3"] : 0
       printf "%-28s %9.1f %9.1f %9.1f  %.3f\n", b, t[b, "fa3"], t[b, "fa2"], t[b, "vllm_fa3"], r}}' \
  $OUT/prefill_sweep.txt
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs tests/test_gpu_prefill.py \
  > $OUT/gpu_prefill.txt 2>&1
prc=$?; echo "gpu prefill tests rc=$prc"; tail -3 $OUT/gpu_prefill.txt
src=vllm_metax/configs/device_name=$(echo "$gpu" | tr ' ' _).json
if [ "$prc" = 0 ] && [ -f "$src" ] && python3 bench/tools/with_prefill.py "$src" $OUT/prefill_sweep.db /tmp/tuned_pf; then
  cp /tmp/tuned_pf/device_name=*.json $OUT/tuned_config_prefill.json; export CONFIG=/tmp/tuned_pf
fi
[ "${SERVE:-1}" = 1 ] && TOTAL_S=$(( total - ($(date +%s) - start) )) bash bench/tools/serve_device_run.sh 2>&1 | tail -${TAIL:-30}
