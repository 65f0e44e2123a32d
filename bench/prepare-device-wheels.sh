#!/usr/bin/env bash
# The packages the sweep needs that the H200 image lacks (optuna, sqlite-utils and their
# dependencies), as cp312 wheels in .whl/ (git-ignored). Run once from the project root, beside
# ../shared/gpu/prepare-carry --with-vllm; then carry [".carry", ".whl"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for w in optuna==5.1.0 sqlite-utils==4.2.1 sqlalchemy==2.1.9 alembic==1.20.1 colorlog==6.12.0 \
         mako==1.4.3 sqlite-fts4==1.0.3 click-default-group==1.2.4; do
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 -d .whl "$w"
done
ls .whl
