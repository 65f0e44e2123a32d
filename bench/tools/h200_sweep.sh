#!/usr/bin/env bash
# One device call on the lent GPU (H200 or H100; #15 item 3): the full default sweep (DeepSeek-V3 TP1+TP8, 96 uniform buckets
# plus 8 zipf buckets, every candidate correctness-gated through the real kernels), timed from a
# fresh DB (JIT included when the machine is cold), then bench/tuned_vs_auto.py on the DB and
# config it wrote. Everything lands in $OUT: sweep.txt (its last lines: the `time:` split and
# `sweep wall N s`), results.db, configs/, tuned_vs_auto_h200.{md,json}.
#   here, once: ../shared/gpu/prepare-carry --with-vllm && bench/tools/prepare-device-wheels.sh
#   on the device machine (carry .carry and .whl):  bash bench/tools/h200_sweep.sh [total_seconds]
# TUNED_VS_AUTO=0 skips the comparison; PREFILL=1 runs the prefill sweep into the same DB and
# emits the config again (decode + prefill sections) before the comparison. SWEEP_BUDGET caps the sweep (default 420 s, so the call fits 600 s even if it is slow; the goal
# is <= 150 s, where the cap does not bind); MLA_TUNE_JIT_PREBUILD=0 compiles FlashInfer in the
# worker instead of in the background.
TOTAL_S=${1:-590} source bench/tools/call-clock.sh   # set -u; start, total, left
source bench/tools/device-setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
ls /tmp/fiws 2>/dev/null | head -3 | sed 's/^/JIT cache present: /'

budget=${SWEEP_BUDGET:-420}
rm -rf "$OUT/results.db" "$OUT/results.db-wal" "$OUT/results.db-shm" "$OUT/results.optuna.log" "$OUT/configs"
mkdir -p "$OUT/configs"
echo "== default sweep, time budget ${budget} s"
/usr/bin/time -f "sweep wall %e s" timeout $(( budget + 60 )) python3 -m mla_tune sweep \
  --db "$OUT/results.db" --configs-dir "$OUT/configs" --time-budget "$budget" -q > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$?"
tail -12 "$OUT/sweep.txt"
python3 -c "import sqlite3, sys; c=sqlite3.connect(sys.argv[1]); c.execute('pragma wal_checkpoint(truncate)')" "$OUT/results.db"
if [ "${PREFILL:-0}" = 1 ]; then
  # the DB that ships holds the prefill trials too: the prefill sweep into the same DB, then the
  # config emitted again from it (decode and prefill sections)
  echo "== prefill-sweep ($(left) s left)"
  /usr/bin/time -f "prefill-sweep wall %e s" timeout 120 python3 -m mla_tune prefill-sweep \
    --db "$OUT/results.db" > "$OUT/prefill_sweep.txt" 2>&1
  echo "prefill-sweep rc=$?"; tail -4 "$OUT/prefill_sweep.txt"
  python3 -c "import sqlite3, sys; c=sqlite3.connect(sys.argv[1]); c.execute('pragma wal_checkpoint(truncate)')" "$OUT/results.db"
  python3 -m mla_tune emit --db "$OUT/results.db" --out "$OUT/configs" > "$OUT/emit.txt" 2>&1
  echo "emit rc=$?"; tail -3 "$OUT/emit.txt"
fi
# the device tool brings back no file with '=' in its name: a copy under a plain name (h200, h100)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
short=$(echo "$gpu" | grep -oiE 'H[0-9]{3}' | head -1 | tr 'H' 'h'); short=${short:-gpu}
cfg=$(ls "$OUT"/configs/device_name=*.json 2>/dev/null | head -1)
[ -n "$cfg" ] && cp "$cfg" "$OUT/tuned_config_$short.json"

echo "== tuned vs auto ($(left) s left)"
if [ "${TUNED_VS_AUTO:-1}" != 0 ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 bench/tuned_vs_auto.py --db "$OUT/results.db" \
    --config "$cfg" --out "$OUT" --name "tuned_vs_auto_$short" \
    --budget-s $(( $(left) - 50 )) > "$OUT/tuned_vs_auto.txt" 2>&1
  echo "tuned_vs_auto rc=$?"
  tail -25 "$OUT/tuned_vs_auto.txt"
fi
echo "done in $(( $(date +%s) - start )) s"
