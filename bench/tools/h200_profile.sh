#!/usr/bin/env bash
# One device call: where the sweep's wall time goes. A cold default sweep under a time budget
# with cProfile on the parent (parent.prof) and on the measuring worker (MLA_TUNE_PROFILE:
# worker-<pid>.prof), its `time:` line in sweep.txt; then `pytest -m gpu` into pytest_gpu.txt.
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_profile.sh [sweep_budget_s]
# Read the profiles here: python -m pstats <file>, or bench/profile_summary.py <folder>.
set -u
budget=${1:-90}
source bench/tools/device-setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p "$OUT/prof" "$OUT/configs"
echo "== profiled default sweep, budget ${budget} s"
MLA_TUNE_PROFILE="$OUT/prof" /usr/bin/time -f "sweep wall %e s" timeout $(( budget + 120 )) \
  python3 -m cProfile -o "$OUT/prof/parent.prof" -m mla_tune sweep --db "$OUT/results.db" \
  --configs-dir "$OUT/configs" --time-budget "$budget" -q > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$?"; tail -8 "$OUT/sweep.txt"
python3 -c "import sqlite3, sys; c=sqlite3.connect(sys.argv[1]); c.execute('pragma wal_checkpoint(truncate)')" "$OUT/results.db"
rm -rf "$OUT/configs"
echo "== pytest -m gpu"
timeout ${PYTEST_S:-330} python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?"; tail -5 "$OUT/pytest_gpu.txt"
