# Sourced (not run) by the bench/h200_*.sh device scripts: the carried FlashInfer/vLLM environment,
# the sweep's wheels from .whl/ (bench/prepare-device-wheels.sh), the forced platform, and $OUT.
source .carry/device-env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site2 VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
