#!/usr/bin/env bash
# The plugin's FlashInfer paths (decode op, vLLM builder/impl, prefill) against a real
# flashinfer-python 0.2.6.post1, the flat API MetaX's vendor build speaks, on the lent H200.
#   here, once: pip download --no-deps flashinfer-python==0.2.6.post1 (an sdist), then
#     FLASHINFER_ENABLE_AOT=0 pip wheel --no-deps --no-build-isolation -w .fi026 <the sdist>
#   there (carry .carry and .fi026, after source .carry/device-env.sh):  bash bench/tools/h200_flashinfer026.sh [seconds]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi026 .fi026/*.whl
export VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=/tmp/fi026:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fiws026 timeout ${1:-240} python3 -m pytest -q \
  -p no:cacheprovider -o addopts=-ra tests/test_gpu_prefill.py tests/test_gpu_plugin.py \
  tests/test_gpu_flashinfer.py -k "${FI026_K:-not 128]}" > "$OUT/pytest_gpu_flashinfer026.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu_flashinfer026.txt"
PYTHONPATH=/tmp/fi026:$PYTHONPATH python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)" >> "$OUT/pytest_gpu_flashinfer026.txt" 2>&1
tail -25 "$OUT/pytest_gpu_flashinfer026.txt"
