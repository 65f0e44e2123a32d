# Sourced from the project root on the lent GPU (carry .dev, and .fa3 where packed): unpacks what
# bench/tools/prepare-serve-carry.sh packed into /tmp/site once per machine, registers this project's
# entry points (its vLLM platform plugin among them) without installing it, forces the platform.
mkdir -p /tmp/site /tmp/fiws
# FlashInfer's JIT cache as an earlier machine packed it (serve_device_run.sh JIT_OUT=1, carried as
# .fijit/): same paths here, so its kernels are not rebuilt at every fresh machine's server start
if [ -f .fijit/flashinfer_jit.tar.xz ] && [ ! -f /tmp/fiws/.jit-unpacked ]; then
  tar -C /tmp/fiws -xJf .fijit/flashinfer_jit.tar.xz && touch /tmp/fiws/.jit-unpacked
fi
if [ ! -f /tmp/site/.serve-env-ok ]; then
  if [ ! -d .dev ]; then
    echo "serve-env: no .dev here and a bare machine: carry .dev (bench/tools/prepare-serve-carry.sh)" >&2
    return 3 2>/dev/null || exit 3
  fi
  for a in flashinfer vllm site; do [ -f .dev/$a.tar.xz ] && tar -C /tmp/site -xJf .dev/$a.tar.xz; done   # FlashInfer: where carried
  xz -dc .dev/_C_stable_libtorch.abi3.so.xz > /tmp/site/vllm/_C_stable_libtorch.abi3.so
  v=$(cat .dev/vllm.version)
  mkdir -p /tmp/site/vllm-$v.dist-info
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$v" > /tmp/site/vllm-$v.dist-info/METADATA
  touch /tmp/site/.serve-env-ok
fi
# FlashInfer 0.7 carried into a machine whose /tmp/site was unpacked without it (a MetaX-profile
# call before this one on the same warm machine)
[ -f .dev/flashinfer.tar.xz ] && [ ! -d /tmp/site/flashinfer ] && tar -C /tmp/site -xJf .dev/flashinfer.tar.xz
if [ -f .fa3/_vllm_fa3_C.abi3.so.xz ] && [ ! -f /tmp/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ]; then
  xz -dc .fa3/_vllm_fa3_C.abi3.so.xz > /tmp/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
fi
python3 - <<'PY'
import pathlib, tomllib
p = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
d = pathlib.Path("/tmp/site") / f"{p['name'].replace('-', '_')}-0.0.0.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: 0.0.0\n")
eps = p.get("entry-points", {})
(d / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) for group, items in eps.items()))
PY
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONPYCACHEPREFIX=/tmp/pycache
export PATH="$(dirname "$(command -v python3)"):$PATH"   # ninja sits beside python3
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 VLLM_METAX_FORCE=1
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so '; then   # flashinfer links with -lcuda
  mkdir -p /tmp/cudastub
  [ -f /tmp/cudastub/libcuda.so ] || echo "" | gcc -shared -Wl,-soname,libcuda.so.1 -o /tmp/cudastub/libcuda.so -x c -
  export LIBRARY_PATH=/tmp/cudastub${LIBRARY_PATH:+:$LIBRARY_PATH}
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
