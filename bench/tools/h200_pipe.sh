#!/usr/bin/env bash
# One device call for the split kernel's pipelining (bench/experiments/small_decode_kernel.py --pipe): the
# served TMA kernel (block-table load in its tile loop, 0 copies in flight during a tile's dots per
# bench/results/split_kernel_compile_sm90.txt) against page ids loaded ahead of the loop and
# 32-token tiles at 3-4 stages, on the shapes of small_decode_kernel_h200.txt run `tma`; then the whole
# `pytest -m gpu`. Results in $OUT.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_pipe.sh
set -u
start=$(date +%s)
source bench/tools/device-setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SHAPES=16x1x1024,16x8x1024,16x1x8192,16x2x4096,16x4x2048,16x1x32768,16x4x8192,16x8x32768,16x16x16384,16x32x8192,16x128x2048,128x1x1024,128x8x1024,128x1x8192,128x2x4096,128x1x32768,128x4x16384,128x16x4096
echo "== small_decode_kernel --pipe"
timeout 260 python3 bench/experiments/small_decode_kernel.py --pipe --tag pipe --splits 4,8,16,32,64,128,256 \
  --shapes "$SHAPES" --budget-s 220 --out "$OUT" > "$OUT/pipe_run.txt" 2>&1
echo "pipe rc=$?"; tail -24 "$OUT/small_decode_kernel_pipe_h200.txt" 2>/dev/null || tail -20 "$OUT/pipe_run.txt"
echo "== pytest -m gpu ($(( $(date +%s) - start )) s in)"
timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
grep -E "passed|failed|FAILED|Error|rc=" "$OUT/pytest_gpu.txt" | tail -12
echo "done in $(( $(date +%s) - start )) s"
