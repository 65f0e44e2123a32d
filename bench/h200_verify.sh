#!/usr/bin/env bash
# One device call after a change to the kernel path: the per-step plan cost on a quiet host
# (bench/plan_cost.py --profile), then `pytest -m gpu`.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/h200_verify.sh
set -u
start=$(date +%s)
source bench/device-setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== plan cost"
timeout 150 python3 bench/plan_cost.py --profile --out "$OUT" > "$OUT/plan_cost.txt" 2>&1
echo "plan_cost rc=$?"; grep -E "^- |build_decode" "$OUT/plan_cost.md" | grep -v cProfile | head -20
echo "== pytest -m gpu ($(( $(date +%s) - start )) s in)"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
grep -E "passed|failed|FAILED|Error|rc=" "$OUT/pytest_gpu.txt" | tail -12
echo "done in $(( $(date +%s) - start )) s"
