#!/usr/bin/env bash
# The packages the sweep needs that the H200 image lacks (optuna, sqlite-utils and their
# dependencies), as cp312 wheels in .whl/ (git-ignored). Run once from the project root, beside
# ../shared/gpu/prepare-carry --with-vllm; then carry [".carry", ".whl"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# the sweep's; then what vLLM's engine imports on the way to serving a model (bench/serve_e2e.py)
for w in optuna==5.1.0 sqlite-utils==4.2.1 sqlalchemy==2.1.9 alembic==1.20.1 colorlog==6.12.0 \
         mako==1.4.3 sqlite-fts4==1.0.3 click-default-group==1.2.4 \
         compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0 astor==0.8.1 dill==0.4.1 \
         blake3==1.0.11 lark==1.2.2 orjson==3.13.0 setproctitle==1.3.8 python-json-logger==4.2.0; do
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done
ls .whl
