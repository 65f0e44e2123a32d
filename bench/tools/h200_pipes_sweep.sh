#!/usr/bin/env bash
# One device call for the split family's `pipe` knob (split_decode.PIPES, added 2026-12-05 without
# a GPU): first tests/test_gpu_split.py (every pipe against the torch reference through the family
# and the plugin's check, t32x4-pdl under full CUDA-graph capture and replay through vLLM's builder),
# then, only if it passed, the default sweep with the pipes in its space and tuned_vs_auto
# (bench/tools/h200_sweep.sh: results.db, configs/, sweep.txt, tuned_vs_auto_h200.{md,json} in $OUT).
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_pipes_sweep.sh
set -u
start=$(date +%s)
source bench/tools/device-setup.sh
echo "== tests/test_gpu_split.py"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_gpu_split.py \
  > "$OUT/pytest_gpu_split.txt" 2>&1
rc=$?
echo "pytest rc=$rc" >> "$OUT/pytest_gpu_split.txt"
tail -12 "$OUT/pytest_gpu_split.txt"
if [ "$rc" != 0 ]; then
  echo "a pipe is not right on this GPU (see pytest_gpu_split.txt): no sweep"
  exit 1
fi
left=$(( 590 - ($(date +%s) - start) ))
echo "== sweep + tuned_vs_auto (${left} s left)"
SWEEP_BUDGET=${SWEEP_BUDGET:-300} bash bench/tools/h200_sweep.sh "$left"
