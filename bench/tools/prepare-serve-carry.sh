#!/usr/bin/env bash
# Packs what `vllm serve` + `vllm bench serve` (bench/serve_bench.py) and the sweep need on the
# lent GPU, which has no package access, into .dev/ (git-ignored), under the 64 MiB a device call
# carries: FlashInfer and vLLM's Python files from ../shared/gpu/prepare-carry --with-vllm, every
# wheel (the carry's, bench/tools/prepare-device-wheels.sh's and the HTTP server's and client's below)
# unpacked into one xz archive (a third smaller than the wheels), vLLM's compiled ops
# (bench/tools/prepare_device_ops.py). With --fa3 it also packs vLLM's FA3 library into .fa3/
# (172 MB, all sm_90: 7.9 MB stripped and `xz -9e`'d). Every shared library in the wheels is
# stripped of its symbol tables too (uvloop alone drops from 16 MB to 1.8 MB), so .dev/ (~51 MB), .fa3/
# and .fijit/ travel in one call.
#   here, once (after installing the vllm extra):  [LEAN=1] bash bench/tools/prepare-serve-carry.sh [--fa3]
#   there (carry .dev):  source bench/tools/serve-env.sh && ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in /.dev/ /.fa3/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
[ -f .carry/vllm.tar.xz ] || ../shared/gpu/prepare-carry --with-vllm
[ -f .ops/_C_stable_libtorch.abi3.so.xz ] || python3 bench/tools/prepare_device_ops.py
[ -d .whl ] || bash bench/tools/prepare-device-wheels.sh
cache=${XDG_CACHE_HOME:-$HOME/.cache}/mla-tune-serve-wheels
mkdir -p "$cache"
# what vLLM's OpenAI server (uvicorn, fastapi's extras, prometheus) and its benchmark client
# (aiohttp) import beyond the carry, and pynvml (nvidia-ml-py), which vLLM's own CUDA platform
# needs to detect the GPU (serve_bench's vllm_default setup runs without the plugin), and
# model-hosting-container-standards (+ jmespath, supervisor, httpx), which `vllm serve` imports when
# it builds its HTTP app, after the engine is up (missing on the lent H100 of 2026-12-06); versions as vllm==0.33.0 resolves them here
for w in uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0 uvloop==0.23.0 httptools==0.9.0 watchfiles==1.3.0 \
         prometheus_client==0.26.0 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 \
         annotated-doc==0.0.7 pydantic-extra-types==2.11.1 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 \
         aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 \
         httpcore2==2.17.0 einops==0.8.2 cloudpickle==3.1.3 py-cpuinfo==9.0.0 python-dotenv==1.2.4 \
         websockets==17.4 ijson==3.6.0 nvidia-ml-py==13.615.71 \
         model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 httpx==0.29.0 \
         httpcore==1.0.9; do
  name=${w%%==*}; ver=${w#*==}
  ls "$cache"/*.whl 2>/dev/null | grep -qi "/$(echo "$name" | tr '-' '_')-$ver-" && continue
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d "$cache" "$w"
done
rm -rf .dev && mkdir -p .dev
tmp=$(mktemp -d)
for w in .carry/wheels/*.whl .whl/*.whl "$cache"/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
# --lean (serving runs: no sweep): the tree and this carry must fit 64 MiB together, and results.db
# grew to 34 MB: leave out what neither `vllm serve`, `vllm bench serve`, bench/serve_bench.py nor
# `mla-tune prebuild` imports (optuna and its SQL stack) and FlashInfer's expert-parallel MoE
# package (nothing imports it at start); llguidance stays: vLLM's API server imports it
if [ "${LEAN:-0}" = 1 ]; then
  (cd "$tmp/site" && rm -rf sqlalchemy* SQLAlchemy* alembic* optuna* mako* Mako* colorlog*)
fi
find "$tmp/site" -type f -name '*.so*' -exec strip --strip-unneeded {} + 2>/dev/null || true
tar -C "$tmp/site" -cf - . | xz -9 -T0 > .dev/site.tar.xz
rm -rf "$tmp"
cp .carry/flashinfer.tar.xz .carry/vllm.tar.xz .carry/vllm.version .ops/_C_stable_libtorch.abi3.so.xz .dev/
if [ "${LEAN:-0}" = 1 ]; then
  fi_tmp=$(mktemp -d)
  tar -C "$fi_tmp" -xJf .carry/flashinfer.tar.xz && rm -rf "$fi_tmp"/flashinfer/moe_ep
  tar -C "$fi_tmp" -cf - . | xz -9e -T0 > .dev/flashinfer.tar.xz
  rm -rf "$fi_tmp"
fi
if [ "${1:-}" = "--fa3" ]; then
  src=$(python3 -c "import os, vllm; print(os.path.join(os.path.dirname(vllm.__file__), 'vllm_flash_attn', '_vllm_fa3_C.abi3.so'))")
  rm -rf .fa3 && mkdir -p .fa3
  strip --strip-unneeded -o .fa3/_vllm_fa3_C.abi3.so "$src"
  xz -9e -T0 .fa3/_vllm_fa3_C.abi3.so   # -9e: 7.9 MB, against 17 MB at -1
fi
du -sh .dev .fa3 2>/dev/null
