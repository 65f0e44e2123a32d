#!/usr/bin/env bash
# Issue #36 on the lent GPU in one call: the MetaX profile end to end with flashinfer-python
# 0.2.6.post1 (the flat, fa2-only API MetaX's vendor build speaks) in place of 0.7, vLLM's FlashMLA
# library as the vendor's baseline: the sweep (--profile metax), its config, bench/metax_vs_vendor.py
# against the vendor's default order (16 heads per rank, DeepSeek-V3 at TP8, unless SWEEP_ARGS
# says otherwise), and vLLM's engine serving the tiny DeepSeek-V2 with that
# config (greedy tokens teacher-forced against a float32 forward, beside TRITON_MLA and FLASHMLA).
#   here, once: the .fi026 wheel (bench/tools/h200_flashinfer026.sh says how), and
#     xz -9 -c .venv/lib/python3*/site-packages/vllm/_flashmla_C.abi3.so > .ops/_flashmla_C.abi3.so.xz
#   there (carry .carry/vllm.tar.xz .carry/vllm.version .carry/wheels .whl .ops .fi026; the tree
#     without its DBs and bench/results/):  TOTAL_S=585 bash bench/tools/metax_profile_run.sh
#   or after bench/tools/gpu_suite_sweep.sh in the same call (carry .carry .whl .fa3 .m026: .m026 holds
#     FlashInfer 0.2.6 without its CUTLASS headers and the FlashMLA library, 2.8 MB; no vLLM
#     compiled ops fit, so the engine runs are left out)
#   METAX_DB=F METAX_CONFIG=F: no sweep, that DB and config instead
#   PYTEST_FILES=...: those GPU tests first, in the profile
#   VENDOR=0 / ENGINE=0: skip bench/metax_vs_vendor.py / the engine runs (a later call on the warm
#     machine can then serve alone: SERVE=1 VENDOR=0 ENGINE=0 with the same METAX_DB/METAX_CONFIG)
#   SERVE=1: then bench/serve_bench.py in the profile (tuned, untuned = the vendor's default order,
#     triton16); needs `vllm serve`'s packages: carry .dev/site.tar.xz .dev/vllm.tar.xz
#     .dev/_C_stable_libtorch.abi3.so.xz .dev/vllm.version .m026 (and .mx), about 48 MB
source bench/tools/call-clock.sh   # set -u; start, total (TOTAL_S), left
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site /tmp/fiws026
if [ -f .carry/flashinfer.tar.xz ]; then
  source bench/tools/device-setup.sh > /dev/null     # vLLM, the wheels, the project (FlashInfer 0.7 beneath)
else                                                 # no FlashInfer 0.7 carried
  if [ ! -f .dev/site.tar.xz ] && [ ! -f /tmp/site/.serve-env-ok ]; then
    # .carry's vLLM and wheels alone (without .dev): unpacked here, registered by serve-env.sh
    tar -C /tmp/site -xJf .carry/vllm.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wheels/*.whl .whl/*.whl
    v=$(cat .carry/vllm.version); mkdir -p /tmp/site/vllm-$v.dist-info
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$v" > /tmp/site/vllm-$v.dist-info/METADATA
    touch /tmp/site/.serve-env-ok
  fi
  # .dev (the serve carry without its FlashInfer 0.7: vLLM, every wheel, vLLM's compiled ops, so
  # `vllm serve` runs) unpacked where carried; the project registered, the environment set
  source bench/tools/serve-env.sh || exit 3
fi
# FlashInfer 0.2.6.post1 in /tmp/fi026, first on the path: .m026's trimmed copy (no CUTLASS headers,
# which only its sm90 kernels include: fa2's MLA decode and prefill do not), else the .fi026 wheel
if [ ! -d /tmp/fi026/flashinfer ]; then
  mkdir -p /tmp/fi026
  if [ -f .m026/flashinfer026.tar.xz ]; then
    tar -C /tmp/fi026 -xJf .m026/flashinfer026.tar.xz
    mkdir -p /tmp/fi026/flashinfer/data/cutlass/include /tmp/fi026/flashinfer/data/cutlass/tools/util/include
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi026 .fi026/*.whl
  fi
fi
for f in .m026/_flashmla_C.abi3.so.xz .ops/_flashmla_C.abi3.so.xz; do
  [ -f "$f" ] && [ ! -f /tmp/site/vllm/_flashmla_C.abi3.so ] && xz -dc "$f" > /tmp/site/vllm/_flashmla_C.abi3.so
done
[ -f .ops/_C_stable_libtorch.abi3.so.xz ] && [ ! -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ] && \
  xz -dc .ops/_C_stable_libtorch.abi3.so.xz > /tmp/site/vllm/_C_stable_libtorch.abi3.so
export PYTHONPATH=/tmp/fi026:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws026
export VLLM_METAX_FORCE=1 VLLM_METAX_PROFILE=metax
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
short=$(echo "$gpu" | grep -oiE 'H[0-9]{3}' | head -1 | tr 'H' 'h'); short=${short:-gpu}
python3 -c "
import flashinfer, torch
from vllm_metax.core.profile import active_profile
from vllm_metax.ops import flashmla
print('metax run:', torch.cuda.get_device_name(0), 'flashinfer', flashinfer.__version__, flashinfer.__file__)
print('profile', active_profile().name, '| FlashMLA', flashmla.flashmla_available())" 2>&1 | tail -3
echo "setup $(( $(date +%s) - start )) s"
W=/tmp/metax; rm -rf $W; mkdir -p $W/configs
if [ -n "${PYTEST_FILES:-}" ]; then    # GPU tests first, in the profile (FlashInfer 0.2.6 on the path)
  timeout ${PYTEST_S:-90} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rsx \
    $PYTEST_FILES > "$OUT/pytest_metax.txt" 2>&1; echo "pytest rc=$?"; tail -4 "$OUT/pytest_metax.txt"
fi
if [ -n "${METAX_DB:-}" ]; then     # a sweep's DB and its config carried in (.mx/): no sweep
  cp "$METAX_DB" $W/metax.db && cp "$METAX_CONFIG" "$W/configs/device_name=$(echo "$gpu" | tr " " _).json"
  echo "== metax sweep skipped: $METAX_DB, $METAX_CONFIG"
else
echo "== sweep --profile metax ($(left) s left)"
/usr/bin/time -f "sweep wall %e s" timeout ${SWEEP_S:-210} python3 -m mla_tune sweep --profile metax \
  --db $W/metax.db --configs-dir $W/configs --time-budget ${SWEEP_BUDGET:-150} ${SWEEP_ARGS:---tp 8} -q > "$OUT/metax_sweep.txt" 2>&1
echo "sweep rc=$?"; tail -8 "$OUT/metax_sweep.txt"
python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('pragma wal_checkpoint(truncate)')" $W/metax.db
python3 -m mla_tune emit --db $W/metax.db --out $W/configs > "$OUT/metax_emit.txt" 2>&1
echo "emit rc=$?"; tail -4 "$OUT/metax_emit.txt"
cp $W/metax.db "$OUT/metax_$short.db"
fi
cfg=$(ls $W/configs/device_name=*.json 2>/dev/null | head -1)
[ -n "$cfg" ] && cp "$cfg" "$OUT/metax_config_$short.json"
if [ "${VENDOR:-1}" = 1 ] && [ -n "$cfg" ] && [ "$(left)" -gt 60 ]; then
  echo "== metax_vs_vendor ($(left) s left)"
  timeout $(( $(left) - 8 )) python3 bench/metax_vs_vendor.py --db $W/metax.db --config "$cfg" --out "$OUT" \
    --name metax_vs_vendor_$short --budget-s ${VS_BUDGET:-70} > "$OUT/metax_vs_vendor.txt" 2>&1
  echo "metax_vs_vendor rc=$?"; tail -14 "$OUT/metax_vs_vendor.txt"
fi
if [ "${ENGINE:-1}" = 1 ] && [ -n "$cfg" ] && [ "$(left)" -gt 120 ] && [ -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ]; then
  echo "== engine: metax_tuned_eager,triton_eager,flashmla_eager ($(left) s left)"
  VLLM_METAX_MLA_CONFIG_FOLDER=$W/configs timeout $(( $(left) - 10 )) python3 bench/serve_e2e.py --out "$OUT" \
    --runs ${E2E_RUNS:-metax_tuned_eager,triton_eager,flashmla_eager} --timeout 200 > "$OUT/metax_e2e.txt" 2>&1
  echo "serve_e2e rc=$?"; grep -E "PASS|FAIL|tokens|backend" "$OUT/metax_e2e.txt" | tail -12
  grep -hE "vllm_metax|Using .* backend" /tmp/serve_e2e/runs/*.log 2>/dev/null | cut -c1-300 | sort | uniq -c | sort -rn | head -30
  for f in /tmp/serve_e2e/runs/*.log; do [ -f "$f" ] && cp "$f" "$W/e2e_$(basename "$f")"; done
  mv "$OUT/serve_e2e.md" "$W/serve_e2e_md.txt" 2>/dev/null
fi
if [ "${SERVE:-0}" = 1 ] && [ -n "$cfg" ] && [ "$(left)" -gt 150 ]; then
  # the serving benchmark in the profile: tuned (this config) vs untuned (the vendor's default order:
  # FLASHMLA at block 64) vs TRITON_MLA at block 16, under vLLM's own client
  echo "== serve_bench, metax profile ($(left) s left)"
  timeout $(( $(left) - 20 )) python3 bench/serve_bench.py --out $W/serve --models ${MODELS:-h16} \
    --setups ${SETUPS:-tuned,untuned,triton16} --config-folder $W/configs ${SERVE_ARGS:-} > $W/metax_serve.txt 2>&1
  echo "serve_bench rc=$?"; grep -E "^\[|Traceback|Error" $W/metax_serve.txt | tail -30
  cp $W/serve/serve_bench.json "$OUT/metax_serve_bench_$short.json" 2>/dev/null
  cp $W/serve/serve_bench.md "$OUT/metax_serve_bench_$short.md" 2>/dev/null
  pkill -INT -f "vllm.entrypoints.cli.main serve" 2>/dev/null; sleep 2; pkill -KILL -f "vllm.entrypoints.cli.main serve" 2>/dev/null
fi
# at most 8 files come back: the logs go into one archive
cp $W/*.txt $W/*.log "$OUT/" 2>/dev/null; cp $W/serve/*.log "$OUT/" 2>/dev/null
(cd "$OUT" && ls *.txt *.log >/dev/null 2>&1 && tar -czf metax_logs.tgz $(ls *.txt *.log 2>/dev/null) && rm -f *.txt *.log)
echo "done in $(( $(date +%s) - start )) s"
