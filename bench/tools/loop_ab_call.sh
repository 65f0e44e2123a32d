#!/usr/bin/env bash
# Issues 54 and 51 on one warm lent GPU in chained calls (carry .dev .fa3 .loopdb; leave the
# tracked DBs out of the working tree, bench/results/README.md). One tuned server serves both: the
# loop's "before" (the shipped config, recording its traffic) is also #51's tuned arm.
#   CALL=1  record: the shipped config serves CELLS x REPEATS with VLLM_METAX_TRAFFIC set (TOKENS=1:
#           and the served-tokens check), from cold caches (traffic_loop.sh PHASE=record), while
#           `mla-tune prebuild` builds its FlashInfer modules beside the start; then tune:
#           report/sweep/emit --traffic (PHASE=tune)
#   CALL=2  the re-tuned config serves the same cells (PHASE=serve, a warm start) and
#           traffic_loop.py compares; vLLM's own server (FLASH_ATTN_MLA) on the same cells (with the
#           tokens check where TOKENS=1), into the record's results file (serve_bench compares the two and
#           classifies the tokens); then, in what time is left, `pytest -m gpu`
#   CALL=3  (an H100) issue 51's prefill A/B: the shipped config against its per-step prefill variant
#           (bench/experiments/prefill_step_cost.py --write-config: vLLM's FA3 where FlashInfer's
#           plan makes the step dearer), chat@inf and mid@inf x REPEATS each, both warm starts
#   CALL=4  vLLM's own server started again on its caches (its warm start)
# What comes back (at most 8 files): serve_bench_before.json, serve_bench_after.json, and loop.tgz
# (traffic_loop.sh's files: the traffic, reports, plots, the re-tuned config, its comparison; the
# server logs), refreshed every 20 s, since a call can be taken back; pytest_gpu.txt (CALL=2).
source bench/tools/serve-call.sh
FINAL=$OUT
L=/tmp/loop; mkdir -p $L/before $L/after $L/out
export CACHE_ROOT=/tmp/cache SPEC= WORKLOAD=${WORKLOAD:-mid,chat,long} REPEATS=${REPEATS:-5} TOKENS=${TOKENS:-0}
export CELLS=${CELLS:-mid@inf,chat@inf,long@inf} OUT=$L/out
save() {
  cp $L/before/serve_bench.json $FINAL/serve_bench_before.json 2>/dev/null
  cp $L/after/serve_bench.json $FINAL/serve_bench_after.json 2>/dev/null
  tar -C $L -czf $FINAL/loop.tgz $(cd $L && ls -d out before/*.log after/*.log own_warm/*.json own_warm/*.log 2>/dev/null) 2>/dev/null
}
( while sleep 20; do save; done ) &
copier=$!
case ${CALL:-1} in
  1) # the config's FlashInfer modules build beside the server's start: FlashInfer's JIT takes a
     # file lock per module, so the server waits for a module being built and never builds it
     # twice. On a fresh H100 the server alone built them one after another inside its start
     # (326.5 s to ready, 2026-12-07); `mla-tune prebuild` builds the three at once in ~162 s
     # (prebuild's --config default: the config the plugin loads on this GPU, the shipped one)
     mkdir -p $CACHE_ROOT/h16_tuned/flashinfer
     FLASHINFER_WORKSPACE_BASE=$CACHE_ROOT/h16_tuned/flashinfer python3 -m mla_tune prebuild \
       --model deepseek-v3 --tp 8 > $L/out/prebuild.txt 2>&1 &
     SERVE_S=$(( $(left) - ${TUNE_S:-150} )) PHASE=record bash bench/tools/traffic_loop.sh
     tail -4 $L/out/prebuild.txt
     save
     SWEEP_BUDGET=${SWEEP_BUDGET:-$(( $(left) - 110 ))} PHASE=tune bash bench/tools/traffic_loop.sh ;;
  2) SERVE_S=${AFTER_S:-240} PHASE=serve bash bench/tools/traffic_loop.sh
     save
     echo "== vLLM's own server on the same cells ($(left) s left)"
     timeout $(( $(left) - 15 )) python3 bench/serve_bench.py --out $L/before --models h16 \
       --setups vllm_default --workloads "$WORKLOAD" --cells "$CELLS" --repeats "$REPEATS" \
       --cache-root $CACHE_ROOT $([ "$TOKENS" = 1 ] && echo --tokens) 2>&1 | grep -E "^\[|^model|Traceback|Error" | tail -30
     save
     if [ "$(left)" -gt 60 ]; then
       echo "== pytest -m gpu ($(left) s left)"
       cp -rn $CACHE_ROOT/h16_tuned/flashinfer/. /tmp/fiws/ 2>/dev/null
       timeout $(( $(left) - 10 )) python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rfE \
         tests/ > $FINAL/pytest_gpu.txt 2>&1
       echo "pytest rc=$?"; tail -5 $FINAL/pytest_gpu.txt
     fi ;;
  3) if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
       echo "the prefill variant is the H100 config's: not this GPU" >&2
     else
       for v in shipped variant; do
         echo "== prefill A/B: $v ($(left) s left)"
         folder=; [ $v = variant ] && folder=bench/results/prefill_step_variant_h100
         timeout $(( $(left) / 2 + 20 )) python3 bench/serve_bench.py --out $L/ab_$v --models h16 \
           --setups tuned --workloads chat,mid --cells chat@inf,mid@inf --repeats "$REPEATS" \
           --cache-root $CACHE_ROOT ${folder:+--config-folder $folder} 2>&1 \
           | grep -E "^\[|Traceback|Error" | tail -14
         mkdir -p $L/out/prefill_ab; cp $L/ab_$v/serve_bench.json $L/out/prefill_ab/serve_bench_$v.json 2>/dev/null
       done
       python3 bench/traffic_loop.py --before $L/ab_shipped/serve_bench.json \
         --after $L/ab_variant/serve_bench.json --out $L/out/prefill_ab
     fi ;;
  4) echo "== vLLM's own server's warm start ($(left) s left)"
     timeout $(( $(left) - 10 )) python3 bench/serve_bench.py --out $L/own_warm --models h16 \
       --setups vllm_default --cache-root $CACHE_ROOT --start-only 1 2>&1 | grep -E "^\[|Error" | tail -5 ;;
esac
kill $copier 2>/dev/null
pkill -INT -f "vllm.entrypoints.cli.main serve" 2>/dev/null; sleep 1
pkill -KILL -f "vllm.entrypoints.cli.main serve" 2>/dev/null
save
echo "call ${CALL:-1} done in $(( $(date +%s) - start )) s"
