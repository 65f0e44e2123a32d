#!/usr/bin/env bash
# The serving proof on the lent H200: vLLM's compiled ops unpacked next to the carried vLLM, the
# plugin's GPU prefill tests, then bench/serve_e2e.py (vLLM's engine serving a tiny DeepSeek-V2).
#   here, once: ../shared/gpu/prepare-carry --with-vllm && python3 bench/tools/prepare_device_ops.py \
#               && bench/tools/prepare-device-wheels.sh
#   there (carry .carry, .ops and .whl):  bash bench/tools/h200_serve.sh [runs]
set -u
source .carry/device-env.sh
if [ -d .whl ]; then       # bench/tools/prepare-device-wheels.sh: what the engine imports beyond the carry
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site2
fi
xz -dc .ops/_C_stable_libtorch.abi3.so.xz > /tmp/site/vllm/_C_stable_libtorch.abi3.so
export VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, vllm._C_stable_libtorch; print('compiled ops:', torch.ops._C.get_cuda_view_from_cpu_tensor, torch.ops._C_cache_ops.concat_and_cache_mla)"
if [ -z "${SKIP_PYTEST:-}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra ${PYTEST_ARGS:-tests/test_gpu_prefill.py} > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"; tail -15 "$OUT/pytest_gpu.txt"
fi
python3 bench/serve_e2e.py --out "$OUT" ${1:+--runs $1} --timeout ${RUN_TIMEOUT:-240}
echo "serve_e2e rc=$?"
