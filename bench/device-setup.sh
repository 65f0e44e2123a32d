# Sourced (not run) by the bench/h200_*.sh device scripts: the carried FlashInfer/vLLM environment,
# the sweep's wheels from .whl/ (bench/prepare-device-wheels.sh), the forced platform, and $OUT.
source .carry/device-env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site2 VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# byte-compile what was unpacked, as pip does when it installs (the carry unpacks with
# --no-compile): otherwise every process of a run compiles vLLM's sources again (profiled on the
# H200: 9.8 s in the sweep, 6.6 s in its worker)
t0=$(date +%s.%N)
python3 -m compileall -q -j 0 /tmp/site /tmp/site2 mla_tune vllm_metax > /dev/null 2>&1
echo "device-setup: byte-compiled the unpacked packages in $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)") s (an install step, outside every timing)"
