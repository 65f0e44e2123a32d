#!/usr/bin/env bash
# Issue 54's loop on the lent GPU, in three chained calls on one warm machine (each within the
# 10-minute limit; /tmp/loop survives between them while the machine stays warm). Carry .dev
# .fa3 .fijit as for serve_device_run.sh (bench/tools/prepare-serve-carry.sh --fa3). NOT YET RUN
# ON A GPU: written and dry-run on the CPU only (2026-12-07); expect to fix things on first use.
#
#   PHASE=record  serve the workload with the shipped config, recording its traffic
#                 (VLLM_METAX_TRAFFIC), REPEATS times per cell: the "before" numbers
#   PHASE=tune    report --traffic on the shipped config (the prediction's baseline), then
#                 sweep --traffic (resumed from the shipped results.db: measured buckets are
#                 answered from it) and emit --traffic into /tmp/loop/configs, then report
#                 --traffic on the new config (the prediction)
#   PHASE=serve   serve the same workload with the re-tuned config: the "after" numbers, and
#                 bench/traffic_loop.py's comparison (p50 TPOT before/after beside the prediction)
#   PHASE=all     the three in one call (only with a short workload: about 3 server starts)
#
#   MODELS=h16            serve_bench's model (one)
#   WORKLOAD=mid          serve_bench's workload (mid: 48 requests of 4K-12K prompts decoding
#                         together, batch ~24-48)
#   CELLS=mid@16,mid@inf  the workload's rates served (the default for mid; CELLS= serves all
#                         of the workload's rates)
#   REPEATS=3             repeats per cell (3 lets the verdict reach p < 0.1)
#   SPEC='{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 4}'
#                         the servers' --speculative-config (q_len 2 steps where a draft is
#                         proposed; random prompts rarely give ngram one: the recorded traffic
#                         says how many steps had q_len 2). SPEC= (empty) serves without drafts
#   SHARE=0.99            sweep --traffic-share
#   SWEEP_BUDGET=240      sweep --time-budget (s)
#   CACHE_ROOT=/tmp/cache serve_bench --cache-root: both servers start on the caches an earlier call's
#                         h16 tuned server left there (serve_users_run.sh), not cold
#   TOKENS=1              the servers also answer serve_bench's served-tokens check (--tokens)
#   DRY=1                 print what each phase would run; run nothing (works on the CPU)
#
# The carry: .dev and .fa3 leave no room for the tracked results.db (34 MB), so leave the tracked
# DBs out of the working tree for the call (bench/results/README.md) and carry .loopdb/, its 16-head
# rows: sqlite3 delete the other heads' samples, trials and workloads, vacuum, xz -9 (2.3 MB).
set -u
start=$(date +%s)
phase=${PHASE:-all}
L=/tmp/loop; mkdir -p $L
OUT=${OUT:-$L/out}; mkdir -p "$OUT"
model=${MODELS:-h16}
workload=${WORKLOAD:-mid}
repeats=${REPEATS:-3}
spec=${SPEC-'{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 4}'}
share=${SHARE:-0.99}
serve_args=()
[ -n "$spec" ] && serve_args=(--server-args "--speculative-config '$spec'")
[ "${TOKENS:-0}" = 1 ] && serve_args+=(--tokens)
cells=()
default_cells=; [ "$workload" = mid ] && default_cells=mid@16,mid@inf
c=${CELLS-$default_cells}
[ -n "$c" ] && cells=(--cells "$c")
run() {                       # a step: printed (stderr), and run unless DRY=1
  echo "+ $*" >&2
  [ "${DRY:-0}" = 1 ] || "$@"
}
if [ "${DRY:-0}" != 1 ]; then
  source bench/tools/serve-env.sh || exit 3
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
fi
echo "traffic loop: phase $phase, model $model, workload $workload x $repeats, spec ${spec:-none}"

serve() {                     # serve_bench's tuned setup with a config folder into a results folder
  local folder=$1 out=$2
  run timeout ${SERVE_S:-560} python3 bench/serve_bench.py --out "$out" --models "$model" \
    --setups tuned --workloads "$workload" --repeats "$repeats" "${cells[@]}" \
    ${folder:+--config-folder "$folder"} ${CACHE_ROOT:+--cache-root "$CACHE_ROOT"} "${serve_args[@]}"
}

if [ "$phase" = record ] || [ "$phase" = all ]; then
  echo "== record: the shipped config serves, recording to $L/traffic.db"
  rm -f $L/traffic.db
  export VLLM_METAX_TRAFFIC=$L/traffic.db
  serve "" $L/before
  unset VLLM_METAX_TRAFFIC
  run cp $L/traffic.db $L/before/serve_bench.json "$OUT"/
  [ "${DRY:-0}" = 1 ] || grep -h "recording MLA traffic" $L/before/server_*.log | head -2
fi

if [ "$phase" = tune ] || [ "$phase" = all ]; then
  echo "== tune: sweep and emit for the recorded traffic"
  gpu=$( [ "${DRY:-0}" = 1 ] && echo NVIDIA_H100_80GB_HBM3 || nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' _)
  shipped=vllm_metax/configs/device_name=$gpu.json
  if ! run python3 -m mla_tune report --traffic $L/traffic.db --config "$shipped" --format json \
    > $L/report_before.json; then
    echo "the recorded traffic cannot be read (above): nothing to tune for" >&2
    exit 4
  fi
  run python3 -m mla_tune report --traffic $L/traffic.db --config "$shipped" --plot "$OUT/traffic_before.png"
  if [ ! -f $L/results.db ]; then             # the shipped measurements: reused
    if [ -f .loopdb/results16.db.xz ]; then    # results.db's 16-head rows, xz (to fit a carry)
      run sh -c "xz -dc .loopdb/results16.db.xz > $L/results.db"
    else
      run cp results.db $L/results.db
    fi
  fi
  # the sweep's FlashInfer modules: the ones the recording server built (same workspace layout)
  if [ -n "${CACHE_ROOT:-}" ] && [ -d "$CACHE_ROOT/${model}_tuned/flashinfer" ]; then
    run cp -rn "$CACHE_ROOT/${model}_tuned/flashinfer/." "${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}/"
  fi
  run timeout $(( ${SWEEP_BUDGET:-240} + 60 )) python3 -m mla_tune sweep --db $L/results.db \
    --traffic $L/traffic.db --traffic-share "$share" --time-budget "${SWEEP_BUDGET:-240}" \
    --no-emit -q
  rm -rf $L/configs; mkdir -p $L/configs
  run python3 -m mla_tune emit --db $L/results.db --traffic $L/traffic.db --out $L/configs
  run python3 -m mla_tune report --traffic $L/traffic.db --config "$L/configs/device_name=$gpu.json" \
    --format json > $L/report_after.json
  run python3 -m mla_tune report --traffic $L/traffic.db --config "$L/configs/device_name=$gpu.json" \
    --plot "$OUT/traffic_after.png"
  run cp $L/report_before.json $L/report_after.json "$L/configs/device_name=$gpu.json" "$OUT"/
fi

if [ "$phase" = serve ] || [ "$phase" = all ]; then
  echo "== serve: the re-tuned config on the same workload"
  if [ "${DRY:-0}" != 1 ] && ! ls $L/configs/device_name=*.json >/dev/null 2>&1; then
    echo "no re-tuned config in $L/configs (did PHASE=tune run on this machine?): nothing to serve" >&2
    exit 4
  fi
  serve $L/configs $L/after
  run cp $L/after/serve_bench.json "$OUT/serve_bench_after.json"
  run python3 bench/traffic_loop.py --before $L/before/serve_bench.json \
    --after $L/after/serve_bench.json --report-before $L/report_before.json \
    --report-after $L/report_after.json --out "$OUT"
fi
[ "${DRY:-0}" = 1 ] || tar -C $L -czf "$OUT/logs.tgz" $(cd $L && ls -d before/*.log after/*.log 2>/dev/null)
echo "done in $(( $(date +%s) - start )) s"
