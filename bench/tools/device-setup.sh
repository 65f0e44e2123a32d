# Sourced (not run) by the bench/tools/h200_*.sh device scripts: the carried FlashInfer/vLLM environment,
# the sweep's wheels from .whl/ (bench/tools/prepare-device-wheels.sh), the forced platform, and $OUT.
source .carry/device-env.sh
# device-env.sh installs .carry/wheels only on a bare machine; a warm one keeps what an earlier call
# installed, so a wheel added to the carry since then would be missing (vLLM's imports then fail in
# every test that builds its config): install the ones whose dist-info is not there yet
missing=()
for w in .carry/wheels/*.whl; do
  [ -e "$w" ] || continue
  n=$(basename "$w" | cut -d- -f1-2)
  ls -d /tmp/site/"$n".dist-info >/dev/null 2>&1 || missing+=("$w")
done
[ ${#missing[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${missing[@]}"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site2 VLLM_METAX_FORCE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# byte-compile, as pip does when it installs: the carry unpacks with --no-compile, and the image's
# own packages (torch, transformers, sympy under /opt/torch/.venv) had no bytecode Python used, so
# every process of a run compiled them again (profiled on the
# H200: 10.3 s of compile() in the sweep's process, 7.1 s in its worker). All bytecode goes to one
# writable cache (PYTHONPYCACHEPREFIX); the warm import fills it for the image's packages.
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
t0=$(date +%s.%N)
python3 -m compileall -q -j 0 /tmp/site /tmp/site2 mla_tune vllm_metax > /dev/null 2>&1
python3 -c "
import torch, torch._dynamo, torch._inductor, sympy, flashinfer
try:
    import transformers, vllm.v1.attention.ops.triton_decode_attention
except Exception as e:
    print('device-setup: warm import:', type(e).__name__, e)
import mla_tune.tune.sweep.run, mla_tune.measure.worker, mla_tune.measure.trial, mla_tune.families.flashinfer, mla_tune.families.triton_mla
" > /dev/null 2>&1
echo "device-setup: byte-compiled the unpacked packages and the image's in $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)") s (an install step, outside every timing)"
