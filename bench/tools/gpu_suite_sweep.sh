#!/usr/bin/env bash
# One device call (carry .carry, .whl and .fa3; the tree without its DBs and bench/results/, see
# bench/results/README.md): vLLM's FA3 library unpacked beside vllm, the whole `pytest -m gpu`
# suite, then the default sweep with its config and bench/tuned_vs_auto.py (bench/tools/h200_sweep.sh)
# in what is left of TOTAL_S (default 585 s). PYTEST_S caps the tests (default 270 s). The DB and
# config stay in /tmp/work and /tmp/tuned for a chained call (bench/tools/serve_device_run.sh).
source bench/tools/call-clock.sh   # set -u; start, total (TOTAL_S), left
source bench/tools/device-setup.sh
if [ -f .fa3/_vllm_fa3_C.abi3.so.xz ]; then
  d=$(python3 -c "import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec('vllm').origin), 'vllm_flash_attn'))")
  [ -f "$d/_vllm_fa3_C.abi3.so" ] || xz -dc .fa3/_vllm_fa3_C.abi3.so.xz > "$d/_vllm_fa3_C.abi3.so"
  echo "fa3 library: $d/_vllm_fa3_C.abi3.so"
fi
echo "== pytest -m gpu ($(left) s left)"
timeout ${PYTEST_S:-270} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rsx \
  --durations=15 tests/ > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest_gpu.txt"
grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -5
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.txt" | head -20
if [ "${SWEEP:-1}" = 1 ]; then
  bash bench/tools/h200_sweep.sh "$(( $(left) - 5 ))"
  # kept while the machine stays warm, where bench/tools/serve_device_run.sh looks (a chained call
  # carrying .dev: tuned_vs_auto, the servers, the prefill sweep on this sweep's DB and config)
  mkdir -p /tmp/work && rm -rf /tmp/tuned && mkdir -p /tmp/tuned
  cp "$OUT/results.db" /tmp/work/results.db && cp "$OUT"/configs/device_name=*.json /tmp/tuned/ 2>/dev/null
fi
echo "all done in $(( $(date +%s) - start )) s"
