#!/usr/bin/env bash
# Issue 51 item 5 on the lent GPU: FlashInfer's JIT cache emptied (a fresh machine's), the modules
# the tuned config serves listed, `mla-tune prebuild` timed, listed again. Run it before
# bench/serve_bench.py in the same call (same FLASHINFER_WORKSPACE_BASE, /tmp/fiws from
# serve-env.sh; same config: CONFIG=<file> where the tuned setup's is not the packaged one), and
# carry no .fijit, so the server's ready time is a cold machine's with a prebuilt cache.
set -u
source bench/tools/serve-env.sh || exit 3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
args=(); [ -n "${CONFIG:-}" ] && args=(--config "$CONFIG")
rm -rf "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer"
python3 -m mla_tune prebuild --dry-run "${args[@]}" 2>&1 | tee "$OUT/prebuild_dry_run.txt"
/usr/bin/time -f "prebuild wall %e s, max rss %M KB" python3 -m mla_tune prebuild "${args[@]}" 2>&1 \
  | tee "$OUT/prebuild.txt"
python3 -m mla_tune prebuild --dry-run "${args[@]}" 2>&1 | tail -1 | tee -a "$OUT/prebuild.txt"
